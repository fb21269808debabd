"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the H200 (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import variant_for


def test_seat_shapes():
    # TP8 rank slice (I = 256): v1 at 1-2 rows, v0 at 3-7, v2 from 8 rows up, whatever the bits
    assert [variant_for(m, 256, k) for k in (2, 3) for m in (1, 2, 4, 7, 8, 16, 24)] == [1, 1, 0, 0, 2, 2, 2] * 2
    assert variant_for(3) == 0  # defaults are the seat's shape


def test_whole_layer_intermediate_uses_v2():
    assert {variant_for(m, 2048, k) for m in (1, 2, 4, 8, 16, 24) for k in (2, 3)} == {2}


def test_unaligned_input_never_reaches_v2_family():
    # v2/v3 load x 16 bytes at a time; the binding rejects an unaligned x for them
    assert variant_for(4, 2048, 2, x_aligned=False) == 0
    assert variant_for(16, 256, 2, x_aligned=False) == 0
    assert variant_for(1, 2048, 2, x_aligned=False) == 1
