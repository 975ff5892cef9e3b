"""The vision tower alone: MLX's kernels against the CPU backend's vision pass, on the bench's model folders.

What a cold image turn waits for before its prefill: mlx-vlm's tower and projector over one 1280x800
screenshot (bench_vision.screenshot), as semantic runs it (``VisionModel.embeddings``). Two ways on the same
loaded model, alternating: plain (MLX's attention and GELU, what mlx_vlm.server runs) and inside
``CpuBackend.vision_pass`` (the host attention with its compiled softmax rows, cpu_math's GELU). Prints the
median seconds of each, their ratio and the largest difference between the two runs' tower outputs (before
the projector), relative to the output's largest value.

Run: ``LD_PRELOAD=... python -m bench.bench_vision_tower [--family gemma3|qwen3_5] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path

import numpy as np

from bench.bench_vision import FAMILIES, bench_folder, screenshot
from bench.common import base_parser
from bench.results import BenchResult

from engine.settings import default_cache_dir


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="gemma3", help="the bench folder's family")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs each way (after one untimed each)")
    args = parser.parse_args()
    import mlx.core as mx
    from PIL import Image

    from engine.models.loader import load_model
    from engine.runtime.runner.backends.cpu import host_softmax
    from engine.runtime.runner.backends.cpu.backend import CpuBackend

    folder = bench_folder(args.cache_dir or default_cache_dir(), tiny=False, family=args.family)
    loaded = load_model(str(folder), args.cache_dir or default_cache_dir(), 256)
    vision = loaded.vision
    picture = Image.open(io.BytesIO(screenshot(1))).convert("RGB")
    inputs = vision.prepare(f"<|im_start|>user\n{vision.marker}What is this?<|im_end|>\n", [picture])
    length = int((inputs.pop("input_ids")[0] == vision.image_token_id).sum())
    inputs.pop("attention_mask", None)
    host_softmax.warm_up()
    backend = CpuBackend()
    backend.attach(loaded.model)

    def plain() -> mx.array:
        features = vision.embeddings(inputs, length)
        mx.eval(features)
        return features

    def passed() -> mx.array:
        with backend.vision_pass():
            return plain()

    print(f"# {args.family} tower over a 1280x800 screenshot: {length} image tokens, "
          f"pixels {tuple(inputs['pixel_values'].shape)}")
    plain(), passed()  # untimed first runs
    times: dict[str, list[float]] = {"mlx": [], "vision_pass": []}
    for repeat in range(args.repeats):
        order = ("mlx", "vision_pass") if repeat % 2 == 0 else ("vision_pass", "mlx")
        for way in order:
            started = time.perf_counter()
            plain() if way == "mlx" else passed()
            times[way].append(time.perf_counter() - started)
    reference = tower_output(vision, inputs)
    with backend.vision_pass():
        ours = tower_output(vision, inputs)
    backend.detach(loaded.model)
    backend.close()
    scale = float(np.abs(reference).max())
    difference = float(np.abs(reference - ours).max()) / scale
    mlx_s, pass_s = statistics.median(times["mlx"]), statistics.median(times["vision_pass"])
    print(f"MLX kernels   {mlx_s:.3f} s (min {min(times['mlx']):.3f}, max {max(times['mlx']):.3f})")
    print(f"vision pass   {pass_s:.3f} s (min {min(times['vision_pass']):.3f}, max {max(times['vision_pass']):.3f})")
    print(f"speed-up      {mlx_s / pass_s:.2f}x; tower outputs differ by at most {difference:.2e} of their largest "
          f"value ({scale:.3g})")
    result = BenchResult("bench_vision_tower", "vision tower: MLX kernels vs the CPU vision pass",
                         args={"family": args.family, "repeats": args.repeats})
    result.metric(args.family, "tower_mlx_s", mlx_s, "s", better="lower")
    result.metric(args.family, "tower_vision_pass_s", pass_s, "s", better="lower")
    result.metric(args.family, "speedup", mlx_s / pass_s, "x")
    result.metric(args.family, "max_relative_output_difference", difference, "ratio", better="lower")
    result.write(args.json)


def tower_output(vision, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The vision tower's last hidden states (before the projector), as mlx-vlm's model calls its tower."""
    import mlx.core as mx

    tower = vision.model.vision_tower
    pixels = mx.array(inputs["pixel_values"])
    if "image_grid_thw" in inputs:  # Qwen-VL: flattened patches and their grid
        out = tower(pixels, mx.array(inputs["image_grid_thw"]))[0]
    else:  # SigLIP: channels last
        out = tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)[0]
    mx.eval(out)
    return np.array(out)


if __name__ == "__main__":
    main()
