"""Serving models to local apps over the Open Inference Protocol and Frigate's ZMQ detector
protocol. The infer path every front end shares (`inference`), HTTP (`api`, `http_limits`,
`listeners`), gRPC (`grpc_server`, `grpc_listen`, `grpc_messages`), Frigate's ZMQ
(`frigate_zmq`) and what a model does with pictures (`pictures`), the protocol's requests
and responses (`protocol`, `requests`, `responses`), shared memory (`shared_memory`), who a
peer is (`peers`), the per-model engine with batching, fail-over and standby (`engine`), the
served models and their set (`models`, `model_set`), the variants job (`variant_job`),
metrics (`metrics`) and the error every front end answers with (`errors`)."""
