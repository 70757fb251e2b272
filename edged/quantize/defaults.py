"""The INT8 gate's defaults and choices, in a module that imports nothing heavy: edgectl's
parsers show them in `--help`, and building a parser must not import numpy or the quantizer."""

# The accuracy budget against the FP32 original is selection's (quantize gates with it too).
from edged.selection.policy import DEFAULT_MAX_DROP  # noqa: F401  (this module's API)

EVAL_SPLIT = 0.2  # share of the calibration samples held out for the accuracy gate
# Which backends gate a quantized model of a format, and which NPUs a .tflite is made for,
# the backends declare (backends.quantize_targets, backends.npu_targets). For an NPU target
# the full-integer model is written even where it does not beat float on this CPU, its form
# is checked for the delegate, and Ethos-U's go through Vela.
ETHOS_U_PREFIX = "ethos-u"  # ethos-u55-128, ethos-u65-256...: Vela's accelerator configs
IO_TYPES = ("int8", "uint8", "float")  # a full-integer .tflite's inputs and outputs
METHODS = ("minmax", "entropy", "percentile")  # activation range calibration
