"""The INT8 gate's defaults and choices, in a module that imports nothing: edgectl's parsers
show them in `--help`, and building a parser must not import numpy or the quantizer."""

DEFAULT_MAX_DROP = 0.01  # accuracy budget against the FP32 original (selection and quantize)
EVAL_SPLIT = 0.2  # share of the calibration samples held out for the accuracy gate
TARGETS = ("onnxruntime", "openvino")  # the backends `edgectl quantize` can gate on
METHODS = ("minmax", "entropy", "percentile")  # activation range calibration
