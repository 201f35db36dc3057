"""A run's model as scikit-learn sees it: a fitted, pre-fitted classifier over the store's features
(``fedhead.load_model``; docs/model.md, "A scikit-learn estimator"). What scikit-learn's estimator checks test on the
predict side is tested here on the trained model; the checks themselves fit the estimator on their own data, which a
federated model cannot do (the last test sorts every check into passed, fits, or does not apply)."""

import pickle
import warnings

import numpy as np
import pytest
from sklearn.base import clone, is_classifier
from sklearn.metrics import accuracy_score, classification_report
from sklearn.utils.validation import check_is_fitted

import fedhead
from extract.store import load_store
from fedhead.federation.config import TrainConfig
from fedhead.federation.model import InvalidInput
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError

D = 16  # the tiny store's feature dimension (tests/conftest.py)
FIT_REFUSED = "fitted by its federated run"


@pytest.fixture(scope="module")
def trained(tiny_store, tmp_path_factory):
    """A closed-form run (one round, seconds) with its IID reference: the model, the store and the run's summary."""
    cfg = TrainConfig(features=str(tiny_store), head="ridge", clients=4, partition="shard", iid_reference=True)
    res = run_training(cfg, out=tmp_path_factory.mktemp("sk") / "run", progress=False)
    return fedhead.load_model(res.run_dir), load_store(tiny_store), res


def _refusal(fn, *args, **kw) -> str:
    """The one-line message of the InvalidInput ``fn(*args, **kw)`` raises (a FedheadError and a ValueError)."""
    with pytest.raises(InvalidInput) as info:
        fn(*args, **kw)
    assert isinstance(info.value, FedheadError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_a_loaded_model_is_a_fitted_classifier(trained):
    from sklearn.utils import get_tags

    m, s, _ = trained
    assert is_classifier(m)
    check_is_fitted(m)  # passes: the run fitted it
    assert get_tags(m).estimator_type == "classifier" and get_tags(m).target_tags.required
    assert list(m.classes_) == list(s.info.class_names) and m.classes_.dtype.kind == "U"
    assert m.n_features_in_ == D
    assert set(m.predict(s.test_x)) <= set(m.classes_)  # predict returns the names in classes_
    assert clone(m) is m and m.get_params() == {} and m.set_params() is m
    msg = _refusal(m.set_params, **{"C": 1.0})
    assert "'params'" in msg and "no parameters" in msg


def test_score_is_the_accuracy_by_hand_and_the_runs_own(trained):
    m, s, res = trained
    names = m.classes_[s.test_y]
    pred = m.predict(s.test_x)
    by_hand = float((pred == names).mean())
    assert m.score(s.test_x, names) == pytest.approx(by_hand) == pytest.approx(res.summary["final_accuracy"])
    assert accuracy_score(names, pred) == pytest.approx(by_hand)
    w = np.linspace(0.5, 2.0, len(names))
    assert m.score(s.test_x, names, sample_weight=w) == pytest.approx(float(((pred == names) * w).sum() / w.sum()))
    report = classification_report(names, pred, labels=m.classes_, zero_division=0, output_dict=True)
    assert report["accuracy"] == pytest.approx(by_hand) and set(m.classes_) <= set(report)
    # the store's integer labels are refused with the mapping to write, rather than scoring every sample wrong
    msg = _refusal(m.score, s.test_x, s.test_y)
    assert "'y'" in msg and "model.classes_[y]" in msg


def test_repr_names_the_head_classes_features_run_and_seed(trained):
    m, _, res = trained
    assert repr(m) == f"Model(head='ridge', classes=10, features={D}, run={res.run_dir.name!r}, seed=0)"
    iid = fedhead.load_model(res.run_dir / "model-seed0-iid.json")
    assert repr(iid).endswith("seed=0, variant='iid')")


@pytest.mark.parametrize("method", ["predict", "predict_proba", "decision_function"])
def test_one_feature_vector_is_refused_with_the_reshape_to_write(method, trained):
    m, s, _ = trained
    fn = getattr(m, method)
    for x in (s.test_x[0], list(map(float, s.test_x[0])), np.float32(1.0)):
        msg = _refusal(fn, x)
        assert f"(n_samples, {D})" in msg, msg
    assert "x.reshape(1, -1)" in _refusal(fn, s.test_x[0]) and "shape (16,)" in _refusal(fn, s.test_x[0])
    one = fn(s.test_x[0].reshape(1, -1))
    all_rows = fn(s.test_x)[:1]  # (a batch of one sums in another order than the whole: a few ulp)
    assert one.shape == all_rows.shape and (np.array_equal(one, all_rows) or np.allclose(one, all_rows, atol=1e-6))


def test_a_wrong_feature_dimension_names_expected_and_got(trained):
    m, s, _ = trained
    msg = _refusal(m.predict, s.test_x[:, :15])
    assert msg.startswith(f"The 'X' parameter must have {D} features per sample"), msg
    assert "Got 15 (an array of shape (100, 15))" in msg
    assert "Got 17" in _refusal(m.predict_proba, np.ones((2, 17), np.float32))


def test_other_input_scikit_learn_refuses_is_refused_in_one_line(trained):
    import scipy.sparse

    m, s, _ = trained
    bad = s.test_x[:3].copy()
    bad[2, 5] = np.nan
    assert "NaN or inf in row 2" in _refusal(m.predict, bad)
    bad[2, 5] = np.inf
    assert "NaN or inf in row 2" in _refusal(m.decision_function, bad)
    assert "Got 1e+39" not in _refusal(m.predict, np.full((1, D), 1e39))  # beyond float32: inf, refused
    assert "sparse" in _refusal(m.predict, scipy.sparse.csr_matrix(s.test_x)).lower()
    assert "Complex" in _refusal(m.predict, s.test_x.astype(np.complex64))
    assert "rows of different lengths" in _refusal(m.predict, [[0.0] * D, [0.0] * (D - 1)])


def test_fit_is_refused_and_frozen_estimator_is_the_way_to_fit(trained):
    m, s, _ = trained
    names = m.classes_[s.test_y]
    with pytest.raises(FedheadError, match=FIT_REFUSED) as info:
        m.fit(s.test_x, names)
    assert "fedhead train" in str(info.value) and "FrozenEstimator" in str(info.value)
    assert not isinstance(info.value, ValueError)  # not mistaken for invalid input by scikit-learn's tools
    frozen_mod = pytest.importorskip("sklearn.frozen")  # scikit-learn >= 1.6
    from sklearn.model_selection import KFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    frozen = frozen_mod.FrozenEstimator(m)
    assert frozen.fit(s.test_x, names) is frozen and frozen.score(s.test_x, names) == m.score(s.test_x, names)
    # cross_val_score fits on each fold's training part: frozen, each test part is scored by the model as it is
    pred = m.predict(s.test_x)
    folds = cross_val_score(frozen, s.test_x, names, cv=KFold(2))
    halves = np.array_split(pred == names, 2)
    assert folds == pytest.approx([h.mean() for h in halves])
    with pytest.raises(ValueError, match=FIT_REFUSED):  # unfrozen, every fit fails with the refusal in the report
        cross_val_score(m, s.test_x, names, cv=KFold(2))
    # a pipeline before the model: the steps fitted, the model frozen
    pipe = make_pipeline(FunctionTransformer(lambda x: x * 1.0), frozen).fit(s.test_x, names)
    assert np.array_equal(pipe.predict(s.test_x), pred)
    assert "FrozenEstimator" in frozen._repr_html_()
    # the raw model as a pipeline's last step predicts unfitted (it is fitted), and its fit says how to fit
    assert np.array_equal(make_pipeline(FunctionTransformer(), m).predict(s.test_x), pred)
    with pytest.raises(FedheadError, match=FIT_REFUSED):
        make_pipeline(FunctionTransformer(), m).fit(s.test_x, names)


def test_predict_side_properties_of_scikit_learns_estimator_checks(trained):
    """check_methods_sample_order_invariance, check_methods_subset_invariance, check_decision_proba_consistency,
    check_classifier_data_not_an_array, check_readonly_memmap_input, check_f_contiguous_array_estimator,
    check_dict_unchanged, check_estimators_pickle and check_estimators_dtypes, on the trained model (each check
    itself fits on its own data first)."""
    import torch

    m, s, _ = trained
    x = s.test_x
    pred, proba, logits = m.predict(x), m.predict_proba(x), m.decision_function(x)
    assert pred.shape == (len(x),) and proba.shape == logits.shape == (len(x), len(m.classes_))
    order = np.random.default_rng(0).permutation(len(x))
    assert np.array_equal(m.predict(x[order]), pred[order])
    assert np.allclose(m.decision_function(x[order]), logits[order], atol=1e-6)
    for part in np.array_split(np.arange(len(x)), 7):
        assert np.array_equal(m.predict(x[part]), pred[part])
    assert np.array_equal(proba.argmax(1), logits.argmax(1)) and np.allclose(proba.sum(1), 1, atol=1e-6)
    for other in (x.tolist(), tuple(map(tuple, x.tolist())), list(x), torch.from_numpy(x).requires_grad_(),
                  np.asfortranarray(x), x.astype(np.float64)):  # fmt: skip
        assert np.array_equal(m.predict(other), pred)
    ro = x.copy()
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning included
        assert np.array_equal(m.predict(ro), pred)
    before = {k: v for k, v in vars(m).items() if k != "encoder"}
    m.predict(x), m.predict_proba(x), m.decision_function(x), m.score(x, m.classes_[s.test_y])
    after = {k: v for k, v in vars(m).items() if k != "encoder"}
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    back = pickle.loads(pickle.dumps(m))
    assert np.array_equal(back.predict(x), pred) and repr(back) == repr(m) and is_classifier(back)
    assert m.predict(np.zeros((0, D), np.float32)).shape == (0,)


def test_a_dataframe_is_features(trained):
    pd = pytest.importorskip("pandas")
    m, s, _ = trained
    assert np.array_equal(m.predict(pd.DataFrame(s.test_x)), m.predict(s.test_x))
    assert "dtype object" in _refusal(m.predict, pd.DataFrame({"a": ["x"], "b": ["y"]}))


# what the checks that do not apply test, and why they cannot pass on a model a federated run fitted
NOT_APPLICABLE = {
    "check_no_attributes_set_in_init": "the constructor takes the run's card and weights: it builds a fitted model",
    "check_parameters_default_constructible": "there is no model without a card and weights (load_model builds it)",
    "check_do_not_raise_errors_in_init_or_set_params": "the constructor takes a card load_model checked first",
    "check_estimators_unfitted": "there is no unfitted model: load_model returns a fitted one",
    "check_fit_check_is_fitted": "there is no unfitted model: check_is_fitted passes from the start",
    "check_n_features_in": "there is no unfitted model: n_features_in_ is there from the start",
}


def _fit_refused(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, FedheadError) and FIT_REFUSED in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_scikit_learns_estimator_checks_pass_or_need_a_fit(trained):
    """check_estimator on the model: the checks of the estimator API pass; every other one fails because it fits the
    estimator on its own data (our fit's refusal in the exception's chain) or does not apply (NOT_APPLICABLE)."""
    estimator_checks = pytest.importorskip("sklearn.utils.estimator_checks")
    m, _, _ = trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            results = estimator_checks.check_estimator(m, on_fail=None, on_skip=None)  # scikit-learn >= 1.6
        except TypeError:
            pytest.skip("check_estimator(on_fail=None) needs scikit-learn >= 1.6")
    status = {}
    for r in results:
        name, exc = r["check_name"], r["exception"]
        if r["status"] == "failed" and name not in NOT_APPLICABLE:
            assert _fit_refused(exc), f"{name} failed for another reason than fit: {exc!r}"
        status.setdefault(name, set()).add(r["status"])
    passed = {n for n, st in status.items() if st == {"passed"}}
    assert {"check_estimator_cloneable", "check_estimator_repr", "check_valid_tag_types", "check_get_params_invariance",
            "check_set_params", "check_mixin_order"} <= passed, status  # fmt: skip
    assert all("failed" in status.get(n, {"failed"}) for n in NOT_APPLICABLE)
