"""Peak host memory while loading a quantized Qwen-Image transformer, measured in a fresh process (run by
tests/test_quantized_loading.py): `python tests/quantized_load_probe.py FOLDER`.

Two loads, each measured from the kernel's high-water mark reset just before it: streamed (the family's loader:
read and quantized layer by layer), then the control (the whole model in bf16 first, then quantized block by
block). Prints JSON per load: the peak resident memory above the level before it, and the bytes of the quantized
model as stored."""

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


def measured(load) -> dict:
    from toolkit.device import trim_host_heap
    from toolkit.quantize import weight_bytes

    gc.collect()
    trim_host_heap()
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current level
    before = status("VmRSS")
    transformer = load()
    result = {"peak_bytes": status("VmHWM") - before, "quantized_bytes": weight_bytes(transformer)}
    del transformer
    return result


def main(folder: str) -> None:
    import torch

    from toolkit.models.qwen_image.adapter import QwenImageAdapter
    from toolkit.quantize import quantize_blockwise

    cpu = torch.device("cpu")

    def streamed():
        return QwenImageAdapter.load_transformer(folder, folder, torch.bfloat16, "qint8", cpu)

    def whole():
        transformer = QwenImageAdapter.load_transformer(folder, folder, torch.bfloat16)
        return quantize_blockwise(transformer, "qint8", list(transformer.transformer_blocks),
                                  list(QwenImageAdapter.QUANTIZATION_EXCLUDE), cpu)

    print(json.dumps({"streamed": measured(streamed), "whole": measured(whole)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
