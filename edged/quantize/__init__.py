"""INT8 variants of a model, made and gated on the device: calibration data (`calibration`,
its config `calibration_spec`), recipes per target backend (`recipes`, defaults in
`defaults`), the quantize run and its accuracy gate (`quantizer` for ONNX,
`tflite_quantizer` and `tflite_graph` for .tflite), its report (`report`) and the variants
the daemon makes from a model's calibration data (`variants`). Gates with edged.selection;
the background job that runs it for the daemon is edged.serving.variant_job."""
