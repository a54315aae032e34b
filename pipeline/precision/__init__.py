"""Every precision's facts (kinds.py), and the precisions other than fp32: calibration, int8
Q/DQ builds, fp16 conversion, float32 widening, ncnn feature masks."""
