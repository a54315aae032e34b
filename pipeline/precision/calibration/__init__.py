"""INT8 calibration math: streaming |x| histograms, clipping thresholds, calibration tables."""
