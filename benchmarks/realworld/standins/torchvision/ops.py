"""Import-time names only (see _absent.py)."""

from ._absent import absent

box_area = absent("ops.box_area")
box_iou = absent("ops.box_iou")
box_convert = absent("ops.box_convert")
generalized_box_iou = absent("ops.generalized_box_iou")
distance_box_iou = absent("ops.distance_box_iou")
complete_box_iou = absent("ops.complete_box_iou")
