"""The audit: what on a system (or an image root) will hurt inference latency.

- `findings`: what a check reports (`Finding`, `Evidence`), the catalogue each check declares
  its stable ids in, the context checks read, and the registry.
- `checks/`: one registered check per module, found by `runner.load_checks` (no hand list).
- `runner`: runs the checks, filters by id prefix, and times each check.
- `report`: text, JSON, JUnit XML and SARIF, and the exit code.
"""
