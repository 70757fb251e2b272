"""Thermal admission's settings and its ladder: as a device's thermal headroom shrinks, each
model steps down (a cheaper verified way to run it, then a limited rate, then shedding)
before the kernel's throttling trip, and back up with hysteresis as it cools. The daemon's
side, which acts on the served models, is edged.serving.thermal_admission (docs/THERMAL.md)."""
