"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the device (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import cluster_kernel_takes, variant_for


def test_v55_serves_every_shape_the_cluster_kernel_does_not():
    # the TP8 slice's cluster range: up to 12 rows at K2, up to 8 at K3; TP1's 2048-wide
    # intermediate never
    shapes = [(m, i, k) for m in (1, 2, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 32) for i in (256, 2048) for k in (2, 3)]
    cluster = {(m, 256, 2) for m in (1, 2, 4, 5, 6, 7, 8, 9, 12)} | {(m, 256, 3) for m in (1, 2, 4, 5, 6, 7, 8)}
    assert {variant_for(*s) for s in shapes if s not in cluster} == {55}
    assert 55 not in {variant_for(*s) for s in cluster}


def test_the_tp8_slice_goes_to_the_cluster_kernel_up_to_where_v55_is_faster():
    # one row at either K runs the build that finishes the activation in every CTA (v26), where every
    # CTA has an SM of its own; from two rows (where v26's second partial buffer costs K3 its second
    # CTA per SM) both run v46 (v40's one partial buffer and rows summed by the unit that completes
    # them, with the relaxed "reads done" arrive: sanitizer-clean in session 24), K2 to twelve rows
    # and K3 to eight, but two K3 rows, where v36 (without the per-row sums) is faster. Past those
    # v55 was faster or tied however it was timed (session 28, H100: K2 13-24 rows, K3 9-24; v54's
    # K3 crossover from session 27 kept, since timed launch by launch v46 wins to nine K3 rows)
    assert variant_for(1, 256, 2) == variant_for(1, 256, 3) == 26
    assert {variant_for(m, 256, 2) for m in range(2, 13)} == {46}
    assert variant_for(2, 256, 3) == 36  # the per-row arrivals cost 0.4-0.6 us at two K3 rows
    assert {variant_for(m, 256, 3) for m in range(3, 9)} == {46}
    assert variant_for(1) == 26  # the defaults are the seat's shape (K2)
    assert {variant_for(m, 256, 2) for m in range(13, 33)} == {55}
    assert {variant_for(m, 256, 3) for m in range(9, 33)} == {55}
    assert variant_for(1, 2048, 2) == 55  # TP1's intermediate is past what the cluster kernel takes


def test_the_cluster_kernel_only_gets_layers_it_takes():
    assert variant_for(1, 256, 2, hidden=1536) == 55  # not whole 1024-column slices
    assert variant_for(1, 256, 2, hidden=16384) == 55
    assert cluster_kernel_takes(4096, 512) and not cluster_kernel_takes(4096, 640)
    assert not cluster_kernel_takes(512, 256)
