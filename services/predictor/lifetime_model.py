"""The learned VM lifetime model behind LAVA: E[T_remaining | uptime, features] plus
remaining-lifetime quantiles.

Training (``train_lifetime_model``): every VM of a trace is repeated at uptime 0 and at
the uptimes 5 min x sqrt(2)^k it lived past, with label = remaining lifetime (uptime
augmentation; ``augment`` says why not at fractions of each VM's own lifetime), each row
weighted by the time it stands for (``augment_weights``), so one model answers both the
placement-time question (uptime 0) and re-predictions of running VMs. Four
gradient-boosted tree ensembles (scikit-learn ``HistGradientBoostingRegressor``):
- the mean: Poisson loss on remaining hours; its log link makes the prediction a
  conditional *mean* (not the mean of logs), which is what LAS and LAVA need;
- quantiles 0.1 / 0.5 / 0.9: quantile (pinball) loss on log1p(remaining hours). Quantiles
  commute with monotone maps, so exponentiating back gives the quantiles of the remaining
  lifetime itself; per row they are sorted so they never cross.

Features are the string map a task carries (``Task.lifetime_features``). At training a
feature whose every value parses as a number becomes numeric; any other becomes
categorical with its 250 most frequent values (rarer and unseen ones count as missing).

Saved with pickle plus a format tag and version (``save`` / ``load``); load only files
you trust, as with any pickle. ``UptimePrior`` is the fallback when no model is
configured: it ignores features and answers from uptime alone.
"""

from __future__ import annotations

import logging
import pickle
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.core.lifetime import lifetime_class

log = logging.getLogger("megha.predictor")

MODEL_FORMAT = "megha-lifetime-model"
MODEL_VERSION = 1
QUANTILE_LEVELS = (0.1, 0.5, 0.9)
# The uptimes (besides 0) every VM that lived past them is repeated at: 5 min x sqrt(2)^k,
# up to ~2,000 h (trees answer between two grid points with one of them).
AUGMENT_GRID_S = 300.0 * 2.0 ** (np.arange(30) / 2.0)
REPREDICT_S = 3600.0  # a running VM is re-predicted about this often (vm-sim, LAVA)
MAX_CATEGORIES = 250  # HistGradientBoosting takes at most 255 bins per feature
HOUR_S = 3600.0


_threadpools = None


def one_thread():
    """Run scikit-learn's OpenMP code on one thread.

    Its default (a thread per core) was 100x *slower* on a shared two-core machine: the
    OpenMP workers spin-wait for cores other processes hold. The sidecar serves concurrent
    requests anyway, and training a model of this size is seconds on one core.
    """
    global _threadpools
    from threadpoolctl import ThreadpoolController

    if _threadpools is None:
        _threadpools = ThreadpoolController()
    return _threadpools.limit(limits=1, user_api="openmp")


class ModelError(RuntimeError):
    """A model file that cannot be used, with the reason."""


@dataclass
class LifetimeEstimates:
    """Predictions for a batch, one row per query."""

    expected_remaining_s: np.ndarray
    quantiles_s: np.ndarray  # (n, len(levels))
    quantile_levels: tuple[float, ...]

    @property
    def lifetime_class(self) -> np.ndarray:
        """LAVA class (1..4) of the expected remaining lifetime."""
        return lifetime_class(self.expected_remaining_s)

    def __len__(self) -> int:
        return len(self.expected_remaining_s)


@dataclass
class FeatureSchema:
    """How string features become model columns; the uptime (hours) is the last column.

    A categorical value becomes its rank by the mean log lifetime of its VMs in the
    training set (for squared-loss trees, splits on categories sorted by mean target are
    as good as arbitrary category subsets), so every column is numeric. That keeps the
    ensembles plain threshold trees, which ``CompiledForest`` can evaluate quickly.
    """

    names: list[str]
    numeric: list[bool]
    vocab: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def fit(cls, columns: Mapping[str, Sequence[str]], lifetime_s: np.ndarray) -> FeatureSchema:
        names = sorted(columns)
        numeric, vocab = [], []
        log_life = np.log1p(np.asarray(lifetime_s, dtype=np.float64) / HOUR_S)
        for name in names:
            values = np.asarray(columns[name], dtype=object)
            present = set(values.tolist()) - {""}
            is_num = bool(present) and all(_is_number(v) for v in present)
            numeric.append(is_num)
            codes: dict[str, float] = {}
            if not is_num:
                top = [
                    v for v, _ in Counter(values[values != ""].tolist()).most_common(MAX_CATEGORIES)
                ]
                means = {v: float(log_life[values == v].mean()) for v in top}
                codes = {
                    v: float(i) for i, v in enumerate(sorted(top, key=lambda v: (means[v], v)))
                }
            vocab.append(codes)
        return cls(names, numeric, vocab)

    def encode_columns(self, columns: Mapping[str, Sequence[str]], n: int) -> np.ndarray:
        """Columnar input (``{feature: values}``) to a float matrix without uptime."""
        X = np.full((n, len(self.names)), np.nan)
        for j, name in enumerate(self.names):
            values = columns.get(name)
            if values is None:
                continue
            if self.numeric[j]:
                X[:, j] = [_number(v) for v in values]
            else:
                lookup = self.vocab[j].get
                X[:, j] = [lookup(v, np.nan) for v in values]
        return X

    ROW_WISE_MAX = 64  # see ``encode``

    def encode(
        self, features: Sequence[Mapping[str, str]], uptime_h: Sequence[float] | None = None
    ) -> np.ndarray:
        """Row input (one mapping per query, a dict or a protobuf map) to a float matrix;
        with ``uptime_h`` that column is appended (the model's input, no copy to add it).

        Small batches (the sidecar's usual query is one VM) are built row by row from one
        list, a few microseconds; large ones column by column, faster per row there."""
        encoders = self._encoders()
        if len(features) > self.ROW_WISE_MAX:
            X = np.empty((len(features), len(encoders) + (uptime_h is not None)))
            for j, (name, encode) in enumerate(encoders):
                X[:, j] = [encode(f.get(name, "")) for f in features]
            if uptime_h is not None:
                X[:, -1] = uptime_h
            return X
        rows = [[encode(f.get(name, "")) for name, encode in encoders] for f in features]
        width = len(encoders)
        if uptime_h is not None:
            for row, u in zip(rows, uptime_h, strict=True):
                row.append(u)
            width += 1
        return np.array(rows, dtype=np.float64).reshape(len(rows), width)

    def _encoders(self) -> list:
        """(feature, value -> float) per column; cached, not pickled (rebuilt on load)."""
        encoders = self.__dict__.get("_encoder_cache")
        if encoders is None:
            encoders = [
                (name, _number if is_num else _Codes(codes).__getitem__)
                for name, is_num, codes in zip(self.names, self.numeric, self.vocab, strict=True)
            ]
            self.__dict__["_encoder_cache"] = encoders
        return encoders

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_encoder_cache", None)
        return state


class _Codes(dict):
    """A category's code; rare and unseen values are missing (NaN), and not inserted."""

    def __missing__(self, key: str) -> float:
        return np.nan


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _number(value: str) -> float:
    if not value:
        return np.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


class CompiledForest:
    """The trees of several fitted ``HistGradientBoostingRegressor`` (here the mean and
    the three quantile models) fused into one set of flat numpy arrays, evaluated for all
    trees of all models at once.

    scikit-learn's own ``predict`` costs milliseconds for a single row (input validation
    plus an OpenMP fork per tree), too slow for a sidecar answering one VM at a time. For
    small batches this walks every tree in lock-step, one round per tree level, with a
    handful of numpy calls per round whatever the number of trees:

    - the nodes of each tree are renumbered breadth-first so that an internal node's two
      children are neighbours (right, then left): the next node is
      ``right_child[node] + (x <= threshold[node])``, one gather fewer than choosing
      between two child arrays;
    - missing values need no test of their own: each row is widened to
      ``[X with NaN as -inf, X]`` and a node reads the first copy of its feature if
      missing values go left (-inf <= any threshold), the second if they go right
      (NaN <= anything is false). Leaves have threshold NaN and are their own right
      child, so a finished tree stays put;
    - the trees are ordered deepest first, so round r only touches the leading trees
      deeper than r (a view, no copy).

    Large batches go to scikit-learn, which is faster per row there. Reads the fitted
    trees' node records (``_predictors``), which are scikit-learn internals: ``compile``
    raises ``ModelError`` if they are not as expected, and the model then keeps using
    scikit-learn throughout.
    """

    def __init__(self, models: Sequence) -> None:
        trees, baseline, widths = [], [], set()
        for m, model in enumerate(models):
            try:
                baseline.append(float(np.asarray(model._baseline_prediction).ravel()[0]))
                widths.add(int(model.n_features_in_))
                for it in model._predictors:
                    for tree in it:
                        nodes = tree.nodes
                        inner = ~nodes["is_leaf"].astype(bool)
                        if np.any(nodes["is_categorical"][inner]):
                            raise ModelError("categorical splits are not compiled")
                        thresholds = nodes["num_threshold"][inner].astype(np.float64)
                        if np.any(np.isnan(thresholds)) or np.any(thresholds == -np.inf):
                            raise ModelError("a split threshold is NaN or -inf")
                        trees.append((m, nodes, int(nodes["depth"].max())))
            except (AttributeError, KeyError, ValueError, TypeError) as err:
                raise ModelError(f"cannot compile the trees ({type(err).__name__}: {err})") from err
        if len(widths) != 1:
            raise ModelError(f"the models take different numbers of features: {sorted(widths)}")
        self.n_features = widths.pop()
        trees.sort(key=lambda t: -t[2])  # deepest first (stable: model order otherwise)
        feature, threshold, right, value, roots, owner = [], [], [], [], [], []
        offset = 0
        for m, nodes, _ in trees:
            is_leaf = nodes["is_leaf"].astype(bool)
            order, pos = [0], {0: 0}  # breadth-first; pos: old node -> new position
            for old in order:
                if not is_leaf[old]:
                    for child in (int(nodes["right"][old]), int(nodes["left"][old])):
                        pos[child] = len(order)
                        order.append(child)
            for old in order:
                if is_leaf[old]:
                    feature.append(0)
                    threshold.append(np.nan)
                    right.append(offset + pos[old])
                    value.append(float(nodes["value"][old]))
                else:
                    f = int(nodes["feature_idx"][old])
                    feature.append(f if nodes["missing_go_to_left"][old] else f + self.n_features)
                    threshold.append(float(nodes["num_threshold"][old]))
                    right.append(offset + pos[int(nodes["right"][old])])
                    value.append(0.0)
            roots.append(offset)
            owner.append(m)
            offset += len(order)
        self.feature = np.array(feature, dtype=np.int64)
        self.threshold = np.array(threshold, dtype=np.float64)
        self.right = np.array(right, dtype=np.int64)
        self.value = np.array(value, dtype=np.float64)
        self.roots = np.array(roots, dtype=np.int64)
        self.owner = np.array(owner, dtype=np.int64)
        self.baseline = np.array(baseline)
        self.models = len(models)
        depth = np.array([d for _, _, d in trees], dtype=np.int64)
        # Round r advances the trees deeper than r: the first active[r] of them.
        self.active = [int(np.count_nonzero(depth > r)) for r in range(int(depth.max(initial=0)))]
        self.depth = len(self.active)

    def raw(self, X: np.ndarray) -> np.ndarray:
        """Raw (link-space) predictions, shape (rows, models)."""
        n, width = X.shape
        if width != self.n_features:
            raise ValueError(f"expected {self.n_features} feature columns, got {width}")
        wide = np.empty((n, 2 * width))
        wide[:, width:] = X
        wide[:, :width] = X
        np.copyto(wide[:, :width], -np.inf, where=np.isnan(X))
        flat = wide.ravel()
        feature, threshold, right = self.feature, self.threshold, self.right
        add = np.add
        if n == 1:
            idx = self.roots.copy()
            for k in self.active:
                at = idx[:k]
                add(right[at], flat[feature[at]] <= threshold[at], out=at)
            keys = self.owner
        else:
            idx = np.tile(self.roots, (n, 1))
            row_start = (np.arange(n) * (2 * width))[:, None]
            for k in self.active:
                at = idx[:, :k]
                add(right[at], flat[feature[at] + row_start] <= threshold[at], out=at)
            keys = (self.owner + self.models * np.arange(n)[:, None]).ravel()
        sums = np.bincount(keys, weights=self.value[idx].ravel(), minlength=n * self.models)
        return sums.reshape(n, self.models) + self.baseline


class LifetimeModel:
    """Mean and quantile models over (features, uptime). Build with ``train_lifetime_model``."""

    # Up to this many rows the compiled trees answer, past it scikit-learn (faster there).
    COMPILED_MAX_ROWS = 32

    def __init__(self, schema: FeatureSchema, mean_model, quantile_models, levels):
        self.schema = schema
        self.mean_model = mean_model
        self.quantile_models = list(quantile_models)
        self.quantile_levels = tuple(levels)
        self.trained_on: dict[str, float] = {}
        self._compiled: CompiledForest | None = None
        self._compile_failed = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_compiled"], state["_compile_failed"] = None, False  # rebuilt on load
        return state

    def compiled(self) -> CompiledForest | None:
        if self._compiled is None and not self._compile_failed:
            try:
                self._compiled = CompiledForest([self.mean_model, *self.quantile_models])
            except ModelError as err:
                self._compile_failed = True
                log.warning("using scikit-learn for every prediction", extra={"why": str(err)})
        return self._compiled

    def predict(
        self, features: Sequence[Mapping[str, str]], uptime_s: Sequence[float] | np.ndarray
    ) -> LifetimeEstimates:
        uptime_h = np.asarray(uptime_s, dtype=np.float64) / HOUR_S
        return self._predict(self.schema.encode(features, uptime_h.tolist()))

    def predict_expected(self, X: np.ndarray, uptime_s: Sequence[float] | np.ndarray):
        """Only E[remaining] (seconds) for encoded rows: what the placement policies use,
        at a quarter of the cost of ``predict_encoded``."""
        uptime_h = np.asarray(uptime_s, dtype=np.float64).reshape(-1, 1) / HOUR_S
        with one_thread():
            return self.mean_model.predict(np.hstack([X, uptime_h])) * HOUR_S

    def predict_encoded(self, X: np.ndarray, uptime_s: Sequence[float] | np.ndarray):
        """``X`` from ``schema.encode*``; re-predicting a VM reuses its row, new uptime."""
        uptime_h = np.asarray(uptime_s, dtype=np.float64).reshape(-1, 1) / HOUR_S
        return self._predict(np.hstack([X, uptime_h]))

    def _predict(self, Xu: np.ndarray) -> LifetimeEstimates:
        """Encoded rows with the uptime (hours) as the last column."""
        forest = self.compiled() if len(Xu) <= self.COMPILED_MAX_ROWS else None
        if forest is not None:
            raw = forest.raw(Xu)
            expected_h, logq = np.exp(raw[:, 0]), raw[:, 1:]  # Poisson loss: log link
        else:
            with one_thread():
                expected_h = self.mean_model.predict(Xu)
                logq = np.array([m.predict(Xu) for m in self.quantile_models]).T
        quantiles_h = np.expm1(np.maximum(np.sort(logq.reshape(len(Xu), -1), axis=1), 0.0))
        return LifetimeEstimates(expected_h * HOUR_S, quantiles_h * HOUR_S, self.quantile_levels)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        import sklearn

        blob = {
            "format": MODEL_FORMAT,
            "version": MODEL_VERSION,
            "sklearn": sklearn.__version__,
            "model": self,
        }
        path.write_bytes(pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL))
        return path


def load_model(path: str | Path) -> LifetimeModel:
    """Load a file written by ``LifetimeModel.save``; ``ModelError`` says why not."""
    path = Path(path)
    try:
        blob = pickle.loads(path.read_bytes())
    except OSError as err:
        raise ModelError(f"cannot read lifetime model {path}: {err.strerror or err}") from None
    except Exception as err:  # unpickling errors come in many types
        raise ModelError(f"{path} is not a lifetime model ({type(err).__name__}: {err})") from None
    if not isinstance(blob, dict) or blob.get("format") != MODEL_FORMAT:
        raise ModelError(f"{path} is not a lifetime model (no {MODEL_FORMAT!r} tag)")
    if blob.get("version") != MODEL_VERSION:
        raise ModelError(
            f"{path} is a version {blob.get('version')} lifetime model; this build reads "
            f"version {MODEL_VERSION}: retrain it with `megha predictor train`"
        )
    import sklearn

    if blob.get("sklearn") != sklearn.__version__:
        log.warning(
            "lifetime model trained with another scikit-learn",
            extra={"trained_with": blob.get("sklearn"), "running": sklearn.__version__},
        )
    return blob["model"]


def augment(lifetime_s: np.ndarray, grid_s: np.ndarray = AUGMENT_GRID_S):
    """Uptime augmentation: (row index, uptime, remaining), sorted by VM then uptime.

    Each VM is repeated at uptime 0 and at every uptime of the absolute grid ``grid_s``
    it lived past, so the rows at any grid uptime u are exactly the VMs alive at u. The
    issue's scheme, rows at 1/8, ..., 7/8 of each VM's *own* lifetime, gives no such
    sample: at uptime u it holds only VMs of lifetimes 8u/7 to 8u, never the longer ones,
    and re-predictions of young VMs came out far too short on the synthetic trace (mean
    5 h predicted against 32 h true at 1 h of uptime; 16 h against 36 h at 4 h).
    """
    lifetime_s = np.asarray(lifetime_s, dtype=np.float64)
    grid = np.concatenate([[0.0], np.asarray(grid_s, dtype=np.float64)])
    rows, idx = np.nonzero(lifetime_s[:, None] > grid[None, :])  # row-major: sorted
    uptime = grid[idx]
    return rows, uptime, lifetime_s[rows] - uptime


def augment_weights(
    rows: np.ndarray, uptime: np.ndarray, lifetime_s: np.ndarray, repredict_s: float = REPREDICT_S
) -> np.ndarray:
    """How many questions each row of ``augment`` stands for.

    A row at uptime 0 is the one question asked when the VM is placed: weight 1, every
    VM alike. A row at uptime u > 0 stands for the uptimes up to the VM's next row (or
    its end), so it weighs (next - u) / ``repredict_s``, the re-predictions a VM gets
    there (then scaled, see below). Unweighted, a VM would count by its number of rows,
    not by the time it is alive.
    """
    lifetime_s = np.asarray(lifetime_s, dtype=np.float64)
    nxt = np.append(uptime[1:], np.inf)
    last = np.append(rows[1:] != rows[:-1], True)
    nxt = np.where(last, lifetime_s[rows], nxt)
    weight = (nxt - uptime) / repredict_s
    at_start = uptime == 0.0
    weight[at_start] = 1.0
    # Placement-time questions and re-predictions weigh the same in total, so the trees
    # (a few dozen shallow ones) do not spend every split on the long VMs' re-predictions.
    later = weight[~at_start].sum()
    if later > 0:
        weight[~at_start] *= at_start.sum() / later
    return weight


def train_lifetime_model(
    features: Mapping[str, Sequence[str]],
    lifetime_s: Sequence[float] | np.ndarray,
    *,
    quantile_levels: Sequence[float] = QUANTILE_LEVELS,
    max_iter: int = 100,
    max_leaf_nodes: int = 31,
    quantile_rows: int = 50_000,
    seed: int = 0,
) -> LifetimeModel:
    """Fit the mean and quantile models on the uptime-augmented trace.

    ``features`` is columnar: ``{name: one string per VM}``. The quantile models see a
    random ``quantile_rows`` of the augmented rows (pinball loss is several times slower
    to fit than the mean's Poisson loss; quantiles need less precision).
    """
    from sklearn.ensemble import HistGradientBoostingRegressor

    lifetime_s = np.asarray(lifetime_s, dtype=np.float64)
    if len(lifetime_s) == 0 or not np.all(lifetime_s > 0):
        raise ValueError("need at least one VM, every lifetime > 0")
    schema = FeatureSchema.fit(features, lifetime_s)
    X = schema.encode_columns(features, len(lifetime_s))
    rows, uptime, remaining = augment(lifetime_s)
    weight = augment_weights(rows, uptime, lifetime_s)
    Xu = np.hstack([X[rows], (uptime / HOUR_S).reshape(-1, 1)])
    remaining_h = remaining / HOUR_S

    def booster(**loss) -> HistGradientBoostingRegressor:
        return HistGradientBoostingRegressor(
            max_iter=max_iter,
            max_leaf_nodes=max_leaf_nodes,
            learning_rate=0.1,
            early_stopping=False,
            random_state=seed,
            **loss,
        )

    with one_thread():
        mean_model = booster(loss="poisson").fit(Xu, remaining_h, sample_weight=weight)
        sample = np.random.default_rng(seed).permutation(len(Xu))[:quantile_rows]
        Xq, log_remaining = Xu[sample], np.log1p(remaining_h[sample])
        wq = weight[sample]
        quantile_models = [
            booster(loss="quantile", quantile=q).fit(Xq, log_remaining, sample_weight=wq)
            for q in quantile_levels
        ]
    model = LifetimeModel(schema, mean_model, quantile_models, quantile_levels)
    model.trained_on = {"vms": float(len(lifetime_s)), "rows": float(len(Xu))}
    return model


class UptimePrior:
    """Fallback without a model: a Lomax (Pareto II) lifetime prior, features ignored.

    P(T > t) = (1 + t / scale) ** -shape with scale 1 h and shape 1.5. Given uptime u the
    remaining lifetime is again Lomax with scale ``1 h + u``, so the longer a VM has run,
    the longer it is expected to run (E[remaining | u] = 2 (1 h + u); median at u = 0 is
    35 min). A documented guess, not a fit: the sidecar logs that it is answering with it.
    """

    shape = 1.5
    scale_s = HOUR_S

    def __init__(self, quantile_levels: Sequence[float] = QUANTILE_LEVELS):
        self.quantile_levels = tuple(quantile_levels)

    def predict(
        self, features: Sequence[Mapping[str, str]], uptime_s: Sequence[float] | np.ndarray
    ) -> LifetimeEstimates:
        scale = self.scale_s + np.asarray(uptime_s, dtype=np.float64)
        expected = scale / (self.shape - 1.0)
        levels = np.asarray(self.quantile_levels)
        quantiles = scale[:, None] * ((1.0 - levels[None, :]) ** (-1.0 / self.shape) - 1.0)
        return LifetimeEstimates(expected, quantiles, self.quantile_levels)
