"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the H200 (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import variant_for


def test_v4_serves_every_decode_shape():
    # the TP8 rank slice (I = 256) and a whole-layer intermediate, K2 and K3, every row count
    assert {variant_for(m, i, k) for m in (1, 2, 4, 7, 8, 16, 24, 32) for i in (256, 2048) for k in (2, 3)} == {4}
    assert variant_for(1) == 4  # the defaults are the seat's shape
