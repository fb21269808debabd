"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the H200 (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import cluster_kernel_takes, variant_for


def test_v4_serves_every_shape_but_up_to_eight_rows_of_the_tp8_slice():
    shapes = [(m, i, k) for m in (1, 2, 4, 7, 8, 9, 16, 24, 32) for i in (256, 2048) for k in (2, 3)]
    assert {variant_for(*s) for s in shapes if not (s[0] <= 8 and s[1] == 256)} == {4}


def test_one_to_eight_rows_of_the_tp8_slice_go_to_the_cluster_kernel():
    # one row: the build for one CTA per SM (both K); from two rows K2 runs the build that finishes
    # the activation in every CTA, and K3, where that build's second partial buffer costs the second
    # CTA per SM, v20
    assert {variant_for(1, 256, k) for k in (2, 3)} == {25}
    assert {variant_for(m, 256, 2) for m in range(2, 9)} == {26}
    assert {variant_for(m, 256, 3) for m in range(2, 9)} == {20}
    assert variant_for(1) == 25  # the defaults are the seat's shape (K2)
    assert variant_for(9) == 4
    assert variant_for(1, 2048, 2) == 4  # TP1's intermediate is past what the cluster kernel takes


def test_the_cluster_kernel_only_gets_layers_it_takes():
    assert variant_for(1, 256, 2, hidden=1536) == 4  # not whole 1024-column slices
    assert variant_for(1, 256, 2, hidden=16384) == 4
    assert cluster_kernel_takes(4096, 512) and not cluster_kernel_takes(4096, 640)
    assert not cluster_kernel_takes(512, 256)
