"""Peak host memory while loading a quantized Qwen-Image transformer, measured in a fresh process (run by
tests/test_quantized_loading.py): `python tests/quantized_load_probe.py streamed|whole FOLDER`.

Prints JSON: the peak resident memory above the level before loading (the kernel's high-water mark, reset just
before), and the bytes of the quantized model as stored."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(mode: str, folder: str) -> None:
    import torch

    from toolkit.models.qwen_image.adapter import QwenImageAdapter
    from toolkit.quantize import quantize_blockwise, weight_bytes

    cpu = torch.device("cpu")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current level
    before = status("VmRSS")
    if mode == "streamed":
        transformer = QwenImageAdapter.load_quantized_transformer(folder, folder, "qint8", torch.bfloat16, cpu)
    else:  # the whole model in bf16 first, then quantized block by block: what the streamed load avoids
        transformer = QwenImageAdapter.load_transformer(folder, folder, torch.bfloat16)
        quantize_blockwise(transformer, "qint8", list(transformer.transformer_blocks),
                           list(QwenImageAdapter.QUANTIZATION_EXCLUDE), cpu)
    print(json.dumps({"peak_bytes": status("VmHWM") - before, "quantized_bytes": weight_bytes(transformer),
                      "after_bytes": status("VmRSS") - before}))


if __name__ == "__main__":
    main(*sys.argv[1:])
