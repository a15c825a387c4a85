"""Runs transformers' Ernie4_5_VLMoeVideoProcessor on videos and saves what it returns, in its own
process: `python video_processor_reference.py SPEC.json OUT_DIR`.

That processor resizes with torchvision. The torchvision wheels this machine's package indices
carry are CUDA builds, whose compiled ops (detection ops: nms, roi_align, ...) cannot load beside
the CPU torch the tests use; torchvision then fails at import, registering fake kernels for ops
that do not exist. The video transforms are plain torch and never call those ops, so when they
cannot load, their names are declared here (calling one raises) and the import goes through. A
separate process, so nothing else under test ever sees this torchvision (transformers would pick
it for every image processor).

SPEC.json: {"cases": [{"processor_dir": D, "video": PATH | null, "frames": NPY | null, "fps": F}]}:
a video file (decoded whole by transformers' `load_video` with its PyAV backend: the
processor itself decodes files with torchcodec only) or an array of all frames [T, H, W, 3] with
its frame rate. OUT_DIR/case-N.npz: pixel_values_videos, video_grid_thw, frames_indices.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import torch

TORCHVISION_OPS = (
    "nms",
    "qnms",
    "roi_align",
    "_roi_align_backward",
    "qroi_align",
    "ps_roi_align",
    "_ps_roi_align_backward",
    "roi_pool",
    "_roi_pool_backward",
    "ps_roi_pool",
    "_ps_roi_pool_backward",
    "deform_conv2d",
    "_deform_conv2d_backward",
)


def _declare_torchvision_ops_if_unloadable() -> torch.library.Library | None:
    """Loads torchvision's compiled ops as torchvision would; where they cannot load, declares
    their names with a kernel that raises, so `import torchvision` succeeds."""
    import importlib.util

    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        raise SystemExit("torchvision is not importable: see docs/multimodal.md (the video processor check)")
    libraries = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        torch.ops.load_library(libraries[0])
        return None
    except (IndexError, OSError):  # none shipped, or one that cannot load beside this torch
        lib = torch.library.Library("torchvision", "DEF")

        def refuse(*args, **kwargs):
            raise RuntimeError("torchvision's compiled ops are not available in this reference process")

        for name in TORCHVISION_OPS:
            lib.define(f"{name}(Tensor x) -> Tensor")
            lib.impl(name, refuse, "CompositeExplicitAutograd")
        return lib


def main(spec_path: str, out_dir: str) -> None:
    _keep = _declare_torchvision_ops_if_unloadable()  # noqa: F841  (the Library must stay alive)
    from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import Ernie4_5_VLMoeVideoProcessor
    from transformers.video_utils import VideoMetadata, load_video

    with open(spec_path) as f:
        cases = json.load(f)["cases"]
    for i, case in enumerate(cases):
        processor = Ernie4_5_VLMoeVideoProcessor.from_pretrained(case["processor_dir"])
        if case.get("video"):  # decoded whole by transformers' PyAV loader, sampled by the processor
            frames, meta = load_video(case["video"], backend="pyav")
        else:
            frames = np.load(case["frames"])
            meta = VideoMetadata(
                total_num_frames=len(frames), fps=float(case["fps"]), frames_indices=list(range(len(frames)))
            )
        out = processor(videos=[frames], video_metadata=[meta], return_tensors="np", return_metadata=True)
        np.savez(
            os.path.join(out_dir, f"case-{i}.npz"),
            pixel_values_videos=out["pixel_values_videos"],
            video_grid_thw=out["video_grid_thw"],
            frames_indices=np.asarray(out["video_metadata"][0].frames_indices),
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
