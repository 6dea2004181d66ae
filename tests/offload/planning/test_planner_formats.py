"""The planner names KV formats through ``paged.KVFormat``: its quantized formats are
``KVFormat.KINDS``, and a ``ModelShape`` / ``Workload`` takes a KVFormat wherever it takes a
format name, with the same plan; byte counts checked by hand."""

import math

import pytest

from offload.planning import KV_FORMATS, ModelShape, Workload, plan
from paged import KVFormat
from tests.offload.planning.test_planner import fixed, h100s, small_model


def test_quantized_formats_are_the_kvformat_kinds():
    assert KV_FORMATS == ("float32", "bfloat16", "float16", *KVFormat.KINDS)


@pytest.mark.parametrize("kind", KVFormat.KINDS)
def test_a_kvformat_is_stored_as_its_kind(kind):
    by_format, by_name = small_model(KVFormat(kind)), small_model(kind)
    assert by_format == by_name and by_format.kv_format == kind


def test_int4_kvformat_brings_its_group_size_and_bytes_by_hand():
    L, K, H, g = 4, 2, 64, 16
    model = small_model(KVFormat("int4", group_size=g), layers=L, K=K, H=H)
    assert model.group_size == g
    by_hand = 2 * L * K * (H // 2 + 2 * (H // g))  # nibbles + a bfloat16 scale per group
    assert (
        model.bytes_per_token() == by_hand == model.bytes_per_token(KVFormat("int4", group_size=g))
    )
    # a KVFormat passed to bytes_per_token counts its own group size, a name the model's
    assert small_model().bytes_per_token(KVFormat("int4", group_size=g)) == by_hand
    assert small_model().bytes_per_token("int4") == 2 * L * K * (H // 2 + 2 * (H // 32))
    assert model.supports(KVFormat("int4", group_size=g))
    assert not model.supports(KVFormat("int4", group_size=128))  # H = 64 holds no group of 128


def test_kivi2_window_counted_from_the_kvformat():
    L, K, H, C, R = 4, 2, 64, 16, 40
    model = small_model("kivi2", layers=L, K=K, H=H)
    pages = math.ceil(R / C) + 1  # the open page and the most recent full pages
    want = 2 * L * K * pages * C * H * 4
    assert model.residual_bytes(KVFormat("kivi2", residual=R), C) == want
    assert model.residual_bytes(KVFormat("kivi2"), C) == model.residual_bytes(None, C)
    assert model.residual_bytes(KVFormat("int8"), C) == 0


def test_workload_quantization_takes_kvformats_with_the_same_plan():
    model = small_model(H=128)
    length = 8192 * 16
    hw = h100s(devices=1, per_node=1, memory=2_500 * 16 * model.bytes_per_token(), host=1 << 50)
    names = Workload(model, fixed(length), quantization=("int8", "int4"))
    formats = Workload(model, fixed(length), quantization=(KVFormat("int8"), KVFormat("int4")))
    assert formats.quantization == ("int8", "int4") and formats == names
    assert plan(formats, hw) == plan(names, hw)
    assert plan(formats, hw).kv_format.value == "int4"


@pytest.mark.no_typecheck
def test_kvformat_errors():
    with pytest.raises(ValueError, match=r"ModelShape: group_size: expected the int4 KVFormat's"):
        ModelShape(4, 8, 2, 64, kv_format=KVFormat("int4", group_size=16), group_size=8)
    with pytest.raises(NotImplementedError, match=r"ModelShape: kv_format: the planner sizes"):
        small_model(KVFormat("kivi2", residual=16))
    with pytest.raises(ValueError, match=r"ModelShape: head_dim: expected a head dim H divisible"):
        small_model(KVFormat("int4", group_size=128))
    with pytest.raises(ValueError, match=r"Workload: quantization: expected KVFormat\(kind='int4'"):
        Workload(small_model(), fixed(1024), quantization=(KVFormat("int4", group_size=16),))
    with pytest.raises(NotImplementedError, match=r"Workload: quantization: the planner sizes"):
        Workload(small_model(), fixed(1024), quantization=(KVFormat("kivi2", residual=8),))
