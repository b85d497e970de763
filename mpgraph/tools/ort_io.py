"""Running an onnxruntime session on numpy feeds when the file has bfloat16 inputs or outputs:
numpy has no bfloat16, so ``session.run`` refuses them. A bf16 value travels as its uint16 bits
into the session (an OrtValue of ONNX type BFLOAT16) and comes back as float32 (exact).

numpy and onnxruntime only: the validating child process imports this file alone (no torch)."""
import ctypes

import numpy as np

BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16
_BF16 = "tensor(bfloat16)"


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bits, as float32 (the high half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_of(value) -> np.ndarray:
    """A bfloat16 OrtValue (on the CPU) as float32, read from its buffer."""
    shape = value.shape()
    n = int(np.prod(shape))
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(value.data_ptr())).copy() \
        if n else np.zeros(0, np.uint16)
    return bf16_bits_to_float32(bits).reshape(shape)


def run(session, feeds: dict) -> list:
    """``session.run(None, feeds)``, where a bfloat16 input may be fed as uint16 bits and a
    bfloat16 output comes back as float32."""
    if not any(v.type == _BF16 for v in session.get_inputs() + session.get_outputs()):
        return session.run(None, feeds)
    import onnxruntime as ort
    types = {v.name: v.type for v in session.get_inputs()}
    given = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, BFLOAT16)
             if types.get(name) == _BF16 and a.dtype == np.uint16 else ort.OrtValue.ortvalue_from_numpy(a)
             for name, a in feeds.items()}
    outs = session.run_with_ort_values(None, given)
    return [_float32_of(v) if v.data_type() == _BF16 else v.numpy() for v in outs]
