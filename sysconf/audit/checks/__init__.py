"""The audit checks, one module each: every module here registers exactly one check
(`sysconf.audit.findings.register`) with the catalogue of the ids it can produce.
`sysconf.audit.runner.load_checks` imports them all, so adding a check is adding a file here
(and its test); tests/sysconf/test_audit_catalogue.py pins every id.
"""
