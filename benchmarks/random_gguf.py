"""A random-weight copy of a GGUF model: the same metadata (tokenizer, chat template, shapes) and
tensor types, random blocks.

For machines that cannot take the real file, such as the device machine (64 MiB a call; the
default model is 98 MB): write the header here (metadata and the tensor list, ~1.8 MB for the
default model), carry it, and write the full-size file there.  The engine runs a copy at the real
file's speed (same kernels, same bytes a token); its text is noise.

    python -m benchmarks.random_gguf header [--model default] /tmp/smollm2.header.gguf
    python -m benchmarks.random_gguf fill /tmp/smollm2.header.gguf /tmp/smollm2-random.gguf

Block scales are fixed (Q4 weights ~0.046 standard deviation, zero mean; Q8_0 ~0.037), so
activations stay finite through all layers.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

TENSORS_KEY = "cpuserve.random_gguf.tensors"  # the header's tensor list: [[name, type, [rows, cols]], ...]
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", TENSORS_KEY}
# Byte offsets and values of each block's float16 fields: Q4_0 (q - 8) d, Q4_1 q d + m, Q8_0 q d.
_SCALES = {"Q4_0": ((0, 0.01),), "Q4_1": ((0, 0.01), (2, -0.075)), "Q8_0": ((0, 0.0005),)}


def _writer(reader, path: str):  # noqa: ANN001, ANN202 - gguf's reader and writer
    """A writer for ``path`` holding every metadata field of ``reader`` but the tensor list."""
    import gguf

    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key in _SKIP:
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    return writer


def _close(writer) -> None:  # noqa: ANN001
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_header(model: str, out: str) -> None:
    """``model``'s metadata plus its tensor list, without tensor data."""
    import gguf

    from engine.loader import resolve_model_path

    reader = gguf.GGUFReader(resolve_model_path(model))
    tensors = [[t.name, t.tensor_type.name, [int(x) for x in reversed(t.shape.tolist())]] for t in reader.tensors]
    writer = _writer(reader, out)
    writer.add_string(TENSORS_KEY, json.dumps(tensors))
    _close(writer)


def fill(header: str, out: str, seed: int = 0) -> None:
    """The full model from a header: every tensor of the list, in its type, with random contents."""
    import gguf

    reader = gguf.GGUFReader(header)
    if TENSORS_KEY not in reader.fields:
        raise SystemExit(f"{header} has no tensor list: write it with `header` first")
    writer = _writer(reader, out)
    rng = np.random.default_rng(seed)
    for name, type_name, shape in json.loads(reader.fields[TENSORS_KEY].contents()):
        if type_name in ("F32", "F16", "BF16") and len(shape) == 1:  # norms: around 1
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if type_name not in _SCALES:
            raise SystemExit(f"{name}: type {type_name} is not supported here (Q4_0, Q4_1, Q8_0, 1-D F32)")
        qtype = gguf.GGMLQuantizationType[type_name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for offset, value in _SCALES[type_name]:
            data[:, :, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        writer.add_tensor(name, data.reshape(rows, -1), raw_dtype=qtype)
    _close(writer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    h = sub.add_parser("header", help="metadata and tensor list of a GGUF model, no tensor data")
    h.add_argument("--model", default="default", help="a GGUF file, or 'default'")
    h.add_argument("out")
    f = sub.add_parser("fill", help="a full-size random-weight model from a header")
    f.add_argument("header")
    f.add_argument("out")
    f.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.command == "header":
        write_header(args.model, args.out)
    else:
        fill(args.header, args.out, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
