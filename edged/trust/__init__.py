"""Only the models you trust: a model file's sha256 and its signature checked before it is
loaded, under [security] models = "off" | "warn" | "enforce".

`settings` holds the [security] table, `digests` the sha256 of files (hashed again only when
a file changes), `signatures` the check of a signature file against the trusted keys or
certificates (OpenSSF model-signing, the optional extra `edged[signing]`, imported only
there), and `verify` the verdict for one file and the policy that refuses, warns or passes
it. The serving code asks `verify.active()` before every load of a model file."""
