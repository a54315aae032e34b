"""metric=detection's old path, kept for imports made before pipeline/metrics/ (benchmarks,
scripts): everything is re-exported from pipeline.metrics.detection."""

from pipeline.metrics.detection import (BOX_FORMATS, FORMATS, IOU_THRESHOLDS, LOW_CONF, Detection,  # noqa: F401
                                        LabelRecord, average_precision, box_iou, dataset_ap, decode, decode_pair, f1,
                                        label_record, match_table, matches, nms, pairwise_iou, ranked_ap, recognise)
