"""Bad input gets a clear error naming the argument, before any work starts."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab


def gla_inputs(**changes):
    x = attnlab.formulation("gla").sample(B=1, T=8, H=2, K=4, V=3)
    x.update(changes)
    return x


ORACLE = attnlab.oracle("gla", "recurrent")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"k": torch.zeros(1, 8, 2, 5, dtype=torch.float64)}, r"k has K=5 .*but q gives K=4"),
        ({"v": torch.zeros(1, 9, 2, 3, dtype=torch.float64)}, r"v has T=9 .*but q gives T=8"),
        ({"q": torch.zeros(8, 2, 4, dtype=torch.float64)}, r"q must have shape \[B, T, H, K\] \(4 dims\)"),
        ({"q": torch.zeros(1, 8, 2, 4, dtype=torch.int64)}, r"q must be a floating-point tensor"),
        ({"q": [[1.0]]}, r"q must be a torch.Tensor"),
        ({"g": torch.full((1, 8, 2, 4), 0.5, dtype=torch.float64)}, r"g must be a log gate .*maximum is 0.5"),
        ({"v": torch.full((1, 8, 2, 3), math.nan, dtype=torch.float64)}, r"v must be finite; it holds nan"),
        ({"scale": "big"}, r"scale must be a finite real number"),
        ({"scale": math.inf}, r"scale must be a finite real number"),
        ({"initial_state": torch.zeros(1, 2, 3, 4, dtype=torch.float64)}, r"initial_state must have shape \[B, H, K, V\] = \(1, 2, 4, 3\)"),
        ({"return_state": "yes"}, r"return_state must be True or False"),
    ],
)
def test_bad_values_raise_value_error_naming_the_argument(changes, message):
    with pytest.raises(ValueError, match=message):
        ORACLE(**gla_inputs(**changes))


def test_unknown_and_missing_arguments_raise_type_error():
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) beta"):
        ORACLE(**gla_inputs(beta=torch.ones(1)))
    x = gla_inputs()
    del x["g"]
    with pytest.raises(TypeError, match=r"missing required tensor argument\(s\): g"):
        ORACLE(**x)


def test_range_checks_of_other_formulations():
    rwkv = attnlab.formulation("rwkv4").sample(T=4, H=1, V=2)
    with pytest.raises(ValueError, match=r"w must be >= 0"):
        attnlab.oracle("rwkv4")(**{**rwkv, "w": -rwkv["w"]})
    delta = attnlab.formulation("deltanet").sample(T=4, H=1, K=2, V=2)
    with pytest.raises(ValueError, match=r"beta must be <= 2"):
        attnlab.oracle("deltanet")(**{**delta, "beta": delta["beta"] + 2})
    lin = attnlab.formulation("linear_attn").sample(T=4, H=1, K=2, V=2)
    with pytest.raises(ValueError, match=r"feature_map must be one of 'elu1', 'identity'"):
        attnlab.oracle("linear_attn")(**lin, feature_map="relu")
    soft = attnlab.formulation("softmax").sample(T=4, H=1, K=2, V=2)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) initial_state"):
        attnlab.oracle("softmax")(**soft, initial_state=torch.zeros(1))


def test_rwkv4_state_accepts_minus_infinity_log_scale_only():
    x = attnlab.formulation("rwkv4").sample(B=1, T=4, H=1, V=2)
    a, b = torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    p = torch.full((1, 2), -math.inf, dtype=torch.float64)
    attnlab.oracle("rwkv4")(**x, initial_state=(a, b, p))
    with pytest.raises(ValueError, match=r"initial_state a must be finite"):
        attnlab.oracle("rwkv4")(**x, initial_state=(a - math.inf, b, p))


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: attnlab.formulation("flash"), ValueError, r"unknown formulation 'flash'; expected one of softmax"),
        (lambda: attnlab.oracle("gla", "blocked"), ValueError, r"form must be one of recurrent, parallel, chunkwise"),
        (lambda: attnlab.oracle("gla", "recurrent", "float128"), ValueError, r"precision must be one of float64, mpmath, float32"),
        (lambda: attnlab.oracle("gla", "chunkwise", chunk_size=0), ValueError, r"chunk_size must be a positive integer; got 0"),
        (lambda: attnlab.oracle("gla", "chunkwise", chunk_size=2.5), ValueError, r"chunk_size must be a positive integer"),
        (lambda: attnlab.oracle("gla", "recurrent", chunk_size=4), TypeError, r"unexpected option\(s\) chunk_size"),
        (lambda: attnlab.oracle("gla", "recurrent", dps=30), ValueError, r"dps applies to precision='mpmath' only"),
        (lambda: attnlab.oracle("gla", "recurrent", stable=False), TypeError, r"unexpected option\(s\) stable"),
        (lambda: attnlab.oracle("rwkv4", "recurrent", stable="no"), ValueError, r"stable must be True or False"),
    ],
)
def test_bad_oracle_configuration(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_oracle_accepts_low_precision_inputs_exactly():
    """fp16 inputs are upcast exactly: the oracle of the rounded inputs equals the float64 oracle of their upcast."""
    x = attnlab.formulation("gla").sample(B=1, T=8, H=1, K=4, V=4)
    half = {n: t.half() for n, t in x.items()}
    assert torch.equal(ORACLE(**half), ORACLE(**{n: t.double() for n, t in half.items()}))


def test_oracle_runs_where_the_inputs_are_and_returns_float64():
    x = attnlab.formulation("deltanet").sample(B=1, T=8, H=1, K=4, V=4)
    o, state = attnlab.oracle("deltanet", "chunkwise", chunk_size=3)(**x, return_state=True)
    assert o.dtype == torch.float64 and o.device == x["q"].device and o.shape == (1, 8, 1, 4)
    assert state.shape == (1, 1, 4, 4)


def test_kernels_read_the_values_of_ranged_inputs_only():
    """A kernel refuses a gate out of range or non-finite, and a non-finite initial state, before launch;
    it does not scan q, k, v (the cost of a full read), so a NaN there comes out as a NaN output."""
    x = {n: t.float() for n, t in gla_inputs().items()}
    gla = attnlab.kernel("gla", "recurrent")
    with pytest.raises(ValueError, match=r"g must be a log gate .*maximum is 0.5"):
        gla(**{**x, "g": torch.full_like(x["g"], 0.5)})
    with pytest.raises(ValueError, match=r"g must be finite; it holds inf"):
        gla(**{**x, "g": torch.full_like(x["g"], math.inf)})
    with pytest.raises(ValueError, match=r"initial_state must be finite; it holds nan"):
        gla(**x, initial_state=torch.full((1, 2, 4, 3), math.nan))
    v = x["v"].clone()
    v[0, 0, 0, 0] = math.nan
    assert torch.isnan(gla(**{**x, "v": v})).any()


def test_value_checks_of_two_dtypes_both_raise():
    """fp16 gates and an fp32 initial state are read back in one buffer per dtype: a bad value in either
    still raises, naming its argument."""
    x = {n: t.half() for n, t in gla_inputs().items()}
    gla = attnlab.kernel("gla", "recurrent")
    with pytest.raises(ValueError, match=r"^initial_state must be finite; it holds nan"):
        gla(**x, initial_state=torch.full((1, 2, 4, 3), math.nan))
    with pytest.raises(ValueError, match=r"^g must be a log gate .*maximum is 0.5"):
        gla(**{**x, "g": torch.full_like(x["g"], 0.5)}, initial_state=torch.zeros((1, 2, 4, 3)))
    gla(**x, initial_state=torch.zeros((1, 2, 4, 3)))


def test_errors_cite_the_contract_section_of_their_formulation():
    import attnlab

    x = attnlab.formulation("gla").sample(T=8, K=4, V=4)
    with pytest.raises(ValueError, match=r"g must be a log gate .*\(see docs/FORMULATIONS.md, section gla\)$"):
        attnlab.oracle("gla")(**{**x, "g": x["g"] + 1})
    with pytest.raises(ValueError, match=r"q must have shape .*\(see docs/FORMULATIONS.md, section gla\)$"):
        attnlab.oracle("gla")(**{**x, "q": x["q"][0]})
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) foo; .*\(see docs/FORMULATIONS.md, section gla\)$"):
        attnlab.oracle("gla")(**x, foo=1)
