"""Counterexamples found by the adversarial search, kept as ``@example`` regressions.

``REGRESSIONS[property]`` lists Cases; each runs first (hypothesis' explicit
phase, even under ``derandomize``) for every target whose formulation it
fits. A failing check prints the line to add here.
"""

from __future__ import annotations

from attnlab.properties.strategies import Case

REGRESSIONS: dict[str, tuple[Case, ...]] = {
    # beta = 2 and nearly parallel keys: an ill-conditioned UT inverse. The delta-rule chunkwise
    # kernel's bf16 hi/lo split dots (2^-16) gave fp16 excess 2.5 here; tf32x3 gives 1.004.
    "matches_oracle": (
        Case(name="deltanet", seed=7574, B=1, T=61, H=1, K=17, V=5, beta_low=2.0, beta_high=2.0,
             key_coherence=0.99, scale=1.246139220448965),
        # K = 1, beta = 1: each step overwrites the state, so every output is +-v_t, exactly
        # representable. The chunk algebra reaches it through cancellation (o_t = sum_j A_qk[t, j] U_j,
        # |U_j| up to 2.4 for |o_t| = 0.1): the bf16 default then ("fp16", Delta rounded to fp16 in the
        # state pass) left o_14 one bf16 ulp off (found on the H100, session 10); "bf16x3" and "tf32x3" are
        # exact, and the default takes "bf16x3" on heads this narrow (kernels/_state_pass.py, FP16_MIN_CHANNELS;
        # "fp16" stays a strict xfail in tests/kernels/test_deltanet.py).
        Case(name="deltanet", seed=0, B=1, T=15, H=1, K=1, V=1, beta_low=0.999, beta_high=1.0),
        # The same for the gated rule at T = 2 (found on the CPU with tools/bf16_on_cpu.py): o_1 = -0.0146 is
        # A_qk[1, 0] U_0 + U_1 with |U| about 1.5-1.9, and "fp16"'s Delta moves it by 4.6%.
        Case(name="gated_deltanet", seed=4, B=1, T=2, H=2, K=1, V=1, beta_low=0.999, beta_high=1.0),
        # kda, K = V = 1, no decay, nearly parallel keys, two chunks (the second of one row): the bf16 default
        # then ("fp16") reached excess 1.59 (found on the CPU with tools/bf16_on_cpu.py, session 10; "fp16" stays
        # a strict xfail in tests/kernels/test_kda.py); "bf16x3", the default on heads this narrow, and "ieee"
        # are at 1.00.
        Case(name="kda", seed=217, B=1, T=65, H=1, K=1, V=1, gate_low=0.0, key_coherence=0.99),
        # kda, beta = 2, key coherence 0.999, no decay: the bf16 default's UT inverse with "fp16" products (2^-11
        # of each operand's peak, amplified by T's conditioning) put o at 14 times bf16's floor (a failure); with
        # bf16 hi/lo parts, as the delta rules' inverse, 2.2 (kernels/_state_pass.py, inverse_precision). Found by
        # the GPU's backward split_and_resume search at B = 2, T = 429, H = 2 (session 40: dq 9.2 there, o 16.2 on
        # the CPU stand-in of the bf16 default); this is that draw at one sequence and head of two chunks, the
        # defect as it was (tools/bf16_on_cpu.py, session 41) at a tenth of the interpreter's time.
        Case(name="kda", seed=52377, B=1, T=128, H=1, K=27, V=99, gate_low=0.0, beta_low=2.0, beta_high=2.0,
             key_coherence=0.999),
        # One token, K = 7: elu+1 features rounded to fp16 before the dots (then linear_attn's
        # default) cost excess 2.84 in fp16; the perturbation is only averaged away over many
        # keys and features. fp32 (hi + lo) features give 1.0.
        Case(name="linear_attn", seed=517, B=1, T=1, H=2, K=7, V=8, key_coherence=0.5101055313207358, spread=4.0,
             scale=1.9673736050656103, options=(("feature_map", "elu1"), ("normalize", False))),
        # The scale left to its default at K > 1: a kernel that defaults softmax's scale to 1 instead of K ** -0.5
        # (the selftest's specimen) is caught whatever the search draws (its draws pass a scale or reach K = 1).
        Case(name="softmax", seed=0, B=1, T=4, H=1, K=16, V=16),
    ),
    # A drawn initial state at K = V = 1 and T = 1: the delta rules' bf16 backward with "fp16" products measured
    # d initial_state 14.2 times bf16's floor (the chunk algebra's cancellations keep a single term's 2^-11);
    # narrow heads now take tf32x3 (found on the H100, session 26; _delta_chunk_backward.FP16_PRODUCTS_MIN_CHANNELS).
    "backward_matches_oracle[dinitial_state]": (
        Case(name="deltanet", seed=0, B=1, T=1, H=1, K=1, V=1),
    ),
    "backward_matches_oracle[dk]": (
        # The same with beta near 0: dk 102 times bf16's floor, dbeta 15.6.
        Case(name="deltanet", seed=0, B=1, T=1, H=1, K=1, V=1, beta_low=0.0, beta_high=0.001),
        # kda at 16 key channels, V = 1: an illegal shared-memory read in the local kernel's span sums on the H100
        # (Triton 3.6's dot on a 16-channel bf16 gate tile; 17 to 32 channels gave gradients off by up to 1e10;
        # session 26, _delta_chunk_backward.NATIVE_SPAN_KEYS).
        Case(name="kda", seed=345, B=2, T=64, H=2, K=16, V=1, beta_low=0.56, beta_high=1.66, scale=2.0),
    ),
    # One position with a drawn state: Gated DeltaNet's dg_0 is a small difference of large parts (the chunk's
    # <S, dS'> among them), and the "fp16" products (S and dS' stored at 2^-11) measured 168 times bf16's floor;
    # problems under 64 positions now take tf32x3 (found with tools/bf16_on_cpu.py, session 27;
    # _delta_chunk_backward.FP16_PRODUCTS_MIN_POSITIONS).
    "backward_matches_oracle[dg]": (
        Case(name="gated_deltanet", seed=2, B=1, T=1, H=1, K=31, V=24, key_coherence=0.999),
        # retnet without decay (g = 0) over 62 steps in fp16: both heads' exact dg lie past fp16's range, the kernel
        # returns their infinities (correctly rounded), and the check, left nothing to measure, raised on an empty
        # max (found by the slow tier on the CPU, session 28; metrics.max_err).
        Case(name="retnet", seed=156, B=1, T=62, H=2, K=16, V=7, gate_low=0.0, key_coherence=0.99, spread=4.0,
             scale=1.6975264769543368),
    ),
    # do zero from position 1: dbeta_0 = A_00 (dO_0 . v_0), a dot over V that cancels 14-fold, and dDelta stored at
    # 2^-11 left it 16.5 times bf16's floor (found on the H100, session 27; the "fp16" path's [C, C] sums now take
    # Delta's and dDelta's residuals, and two positions take tf32x3).
    "backward_causality[dbeta]": (
        Case(name="gated_deltanet", seed=18699, B=1, T=2, H=1, K=31, V=24, key_coherence=0.999, cut=1),
    ),
    # Normalized linear attention at T = 1 in fp32: the state form's numerator and denominator are
    # separate K-term dots, so the output leaves the hull of v by ~3 fp32 roundings (the check's
    # slack counts K for linear_attn since this case).
    "convexity": (
        Case(name="linear_attn", seed=517, B=1, T=1, H=2, K=7, V=8, key_coherence=0.5101055313207358, spread=4.0,
             scale=1.9673736050656103, options=(("feature_map", "elu1"), ("normalize", True))),
    ),
    # fp16, gk absent: general's chunkwise kernel normalised its value columns by their peak over the
    # whole chunk before the split dots, so outputs at positions 7 and 12 moved when later positions
    # changed; normalising by a power of two keeps every entry's rounding its own.
    "causality": (
        Case(name="general", seed=2208985, B=1, T=38, H=2, K=7, V=16, gate_low=0.0, spread=4.0, scale=1.5,
             absent=("gk",), cut=17),
    ),
    # beta = 0: every deltanet output is exactly 0; the check divided the difference between chunk sizes
    # by a zero output (0 / 0) and reported inf for two identical outputs.
    "chunk_size_invariance": (
        Case(name="deltanet", seed=2071880, B=1, T=65, H=1, K=16, V=14, beta_low=0.0, beta_high=0.0),
    ),
}
