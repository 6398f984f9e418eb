"""KV arithmetic against the formula written out by hand (DESIGN.md "Memory")."""

import pytest
from hypothesis import given, strategies as st

from aner_nb.llm import kv_estimate
from aner_nb.llm.errors import ConfigurationError
from aner_nb.llm.memory import kv_row_bytes


def test_f16_rows_are_two_bytes_per_element():
    # 4096 ctx x 32 layers x 8 kv heads x (128*2 + 128*2) bytes = 512 MiB (Llama-3-8B at f16)
    assert kv_estimate(4096, 32, 8, 128, 128, "f16") == 4096 * 32 * 8 * 512 == 512 * 2**20


def test_q8_0_is_34_bytes_per_32_elements():
    assert kv_row_bytes(128, "q8_0") == 4 * 34
    assert kv_estimate(1024, 2, 4, 64, 64, "q8_0") == 1024 * 2 * 4 * (2 * 34 + 2 * 34)


def test_q4_0_is_18_bytes_per_32_elements():
    assert kv_row_bytes(256, "q4_0") == 8 * 18
    assert kv_estimate(512, 18, 1, 256, 256, "q4_0") == 512 * 18 * 1 * (8 * 18 * 2)


def test_k_and_v_head_dims_may_differ():
    # e.g. MLA-style models: K rows of 192, V rows of 128 elements
    assert kv_estimate(100, 3, 2, 192, 128, "f16") == 100 * 3 * 2 * (192 * 2 + 128 * 2)
    assert kv_estimate(100, 3, 2, 192, 128, "q8_0") == 100 * 3 * 2 * (6 * 34 + 4 * 34)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((0, 1, 1, 32, 32, "f16"), "context"),
        ((1, -1, 1, 32, 32, "f16"), "layers"),
        ((1, 1, 1, 32, 32, "q5_1"), "kv_cache_type"),
        ((1, 1, 1, 48, 32, "q4_0"), "multiple"),
        ((1, 1, True, 32, 32, "f16"), "kv_heads"),
    ],
)
def test_bad_inputs_name_the_field(args, needle):
    with pytest.raises(ConfigurationError, match=needle):
        kv_estimate(*args)


@given(
    ctx=st.integers(1, 65536),
    layers=st.integers(1, 128),
    heads=st.integers(1, 64),
    blocks=st.integers(1, 8),
)
def test_quantized_types_are_smaller_than_f16_and_linear_in_context(ctx, layers, heads, blocks):
    dim = 32 * blocks
    f16 = kv_estimate(ctx, layers, heads, dim, dim, "f16")
    q8 = kv_estimate(ctx, layers, heads, dim, dim, "q8_0")
    q4 = kv_estimate(ctx, layers, heads, dim, dim, "q4_0")
    assert q4 < q8 < f16
    assert kv_estimate(2 * ctx, layers, heads, dim, dim, "q8_0") == 2 * q8
