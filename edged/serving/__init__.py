"""Serving models to local apps over the Open Inference Protocol. The infer path both front
ends share (`inference`), HTTP (`api`, `http_limits`, `listeners`) and gRPC (`grpc_server`,
`grpc_listen`, `grpc_messages`), the protocol's requests and responses (`protocol`,
`requests`, `responses`), shared memory (`shared_memory`), who a peer is (`peers`), the
per-model engine with batching, fail-over and standby (`engine`), the served models and
their set (`models`, `model_set`), the variants job (`variant_job`), metrics (`metrics`)
and the error every front end answers with (`errors`)."""
