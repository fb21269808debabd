"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the H200 (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import variant_for


def test_v4_serves_every_decode_shape_but_one_row_of_the_tp8_slice():
    # the TP8 rank slice (I = 256) and a whole-layer intermediate, K2 and K3, every row count
    shapes = [(m, i, k) for m in (1, 2, 4, 7, 8, 16, 24, 32) for i in (256, 2048) for k in (2, 3)]
    assert {variant_for(*s) for s in shapes if not (s[0] == 1 and s[1] == 256)} == {4}


def test_one_row_of_the_tp8_slice_goes_to_the_cooperative_kernel():
    assert {variant_for(1, 256, k) for k in (2, 3)} == {1}
    assert variant_for(1) == 1  # the defaults are the seat's shape
    assert variant_for(1, 2048, 2) == 4  # at TP1 v4 wins at one row too
