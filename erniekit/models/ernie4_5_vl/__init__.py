"""ERNIE-4.5-VL (vision-language): config, vision transformer + resampler, the VL model on the
ERNIE 4.5 text model, hub-layout checkpoints. `family.py` and `configuration.py` import without
paddle."""
