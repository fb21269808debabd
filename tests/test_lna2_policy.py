"""The per-call variant choice (dsv4serve.lna2.policy), as measured on the device (kernels/lna2/NOTES.md)."""

from dsv4serve.lna2.policy import cluster_kernel_takes, preference, served, variant_for


def test_v55_serves_every_shape_the_cluster_kernel_does_not():
    # the TP8 slice's cluster range: up to 12 rows at K2, up to 8 at K3; TP1's 2048-wide
    # intermediate never
    shapes = [(m, i, k) for m in (1, 2, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 32) for i in (256, 2048) for k in (2, 3)]
    cluster = {(m, 256, 2) for m in (1, 2, 4, 5, 6, 7, 8, 9, 12)} | {(m, 256, 3) for m in (1, 2, 4, 5, 6, 7, 8)}
    assert {variant_for(*s) for s in shapes if s not in cluster} == {55}
    assert 55 not in {variant_for(*s) for s in cluster}


def test_the_tp8_slice_goes_to_the_cluster_kernel_up_to_where_v55_is_faster():
    # every cluster point runs v59 (v46 -- one partial buffer, rows completed per slice, the relaxed
    # "reads done" arrive -- whose top-k sum is one fixed-point atomic per output element): session
    # 44 (H100) timed it 1.1-3.2 us faster than the build each point had (v26 at one row, v36 at two
    # K3 rows, v46 elsewhere), K2 to twelve rows and K3 to eight. Past those v55 was faster or tied
    # however it was timed (session 28, H100: K2 13-24 rows, K3 9-24; v54's K3 crossover from
    # session 27 kept, since timed launch by launch v46 wins to nine K3 rows)
    assert variant_for(1, 256, 2) == variant_for(1, 256, 3) == 59
    assert {variant_for(m, 256, 2) for m in range(2, 13)} == {59}
    assert variant_for(2, 256, 3) == 59
    assert {variant_for(m, 256, 3) for m in range(3, 9)} == {59}
    assert variant_for(1) == 59  # the defaults are the seat's shape (K2)
    assert {variant_for(m, 256, 2) for m in range(13, 33)} == {55}
    assert {variant_for(m, 256, 3) for m in range(9, 33)} == {55}
    assert variant_for(1, 2048, 2) == 55  # TP1's intermediate is past what the cluster kernel takes


def test_the_cluster_kernel_only_gets_layers_it_takes():
    assert variant_for(1, 256, 2, hidden=1536) == 55  # not whole 1024-column slices
    assert variant_for(1, 256, 2, hidden=16384) == 55
    # multiples of 1024 that are not 1, 2, 4 or 8 blocks a CTA: the kernel's geometry() refuses them
    # (the policy used to accept them, and the dispatch's fit query then refused the whole layer)
    for hidden in (3072, 5120, 6144, 7168):
        assert not cluster_kernel_takes(hidden, 256) and variant_for(1, 256, 2, hidden=hidden) == 55
        assert served(256, hidden) == [55]
    assert cluster_kernel_takes(4096, 512) and not cluster_kernel_takes(4096, 640)
    assert not cluster_kernel_takes(512, 256)


# What lna2_moe_fit answers at an sm_120 card's 99 KB (101,376 B) a block for the TP8 slice (H 4096,
# I 256, 256 experts, top-k 6), as the binding said on an H100 in session 33 (scripts/lna2_device.py fit,
# smem_limit=101376; results/2026-12-06-h200-s33-fit-experiments.json): the cluster kernel's K3 builds do not fit
# from one row (v26: 115,824 B) or two (v36, v46); v26 at K2 fits 24 rows (its two 8-row partial
# buffers), every other K2 build and v55 all 32. v59 (v46's shared memory) as v46: session 44, H100.
SM120_FIT = {2: {26: 24, 36: 32, 46: 32, 55: 32, 59: 32}, 3: {26: 0, 36: 1, 46: 1, 55: 32, 59: 1}}


def test_on_a_99_kb_card_k3_goes_where_it_fits():
    fit3 = SM120_FIT[3]
    assert variant_for(1, 256, 3, 4096, fit3) == 59  # one K3 row fits (v26 would not)
    assert {variant_for(m, 256, 3, 4096, fit3) for m in range(2, 33)} == {55}
    fit2 = SM120_FIT[2]
    assert [variant_for(m, 256, 2, 4096, fit2) for m in range(1, 33)] == [variant_for(m, 256, 2) for m in range(1, 33)]


def test_a_build_the_fit_does_not_name_counts_as_not_fitting():
    assert variant_for(1, 256, 2, 4096, {55: 24}) == 55
    assert variant_for(2, 256, 3, 4096, {59: 2, 55: 24}) == 59
    assert variant_for(2, 256, 3, 4096, {59: 1, 55: 24}) == 55
    assert variant_for(1, 256, 2, 4096, {}) == 55  # v55 is the last word even when nothing fits
    assert variant_for(1, 256, 2, 4096, None) == 59  # no fit: every build fits (H100 / H200)


def test_preference_lists_end_with_the_build_that_takes_every_shape():
    for m in range(1, 33):
        for k in (2, 3):
            for i in (256, 2048):
                prefs = preference(m, i, k)
                assert prefs[0] == variant_for(m, i, k) and prefs[-1] == 55 and len(set(prefs)) == len(prefs)
    assert served(256, 4096) == [59, 55] and served(2048, 4096) == [55]
