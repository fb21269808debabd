"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the H200 (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import variant_for


def test_seat_shapes():
    # TP8 rank slice (I = 256): v1 only for one K2 row, v4 everywhere else
    assert [variant_for(m, 256, 2) for m in (1, 2, 4, 7, 8, 16, 24)] == [1, 4, 4, 4, 4, 4, 4]
    assert [variant_for(m, 256, 3) for m in (1, 2, 4, 8, 16, 24)] == [4] * 6
    assert variant_for(1) == 1 and variant_for(3) == 4  # defaults are the seat's shape


def test_whole_layer_intermediate_uses_v4():
    assert {variant_for(m, 2048, k) for m in (1, 2, 4, 8, 16, 24) for k in (2, 3)} == {4}
