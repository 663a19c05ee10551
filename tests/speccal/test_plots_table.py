"""Table plots: the figures draw the table's own numbers, titles name device and model, PNGs land."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.costmodel.compat import make_compatibility
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_build import build_table, refit_table
from speccal.plots_table import (
    components_figure,
    fit_figure,
    residuals_figure,
    short_fingerprint,
    table_title,
    write_table_plots,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FINGERPRINT = "sha256:0123456789abcdef0123456789abcdef"
CONTEXTS = ((512, 1, 1024), (2048, 1025, 4096))


def compat(w: int = 3) -> dict:
    return make_compatibility(
        draft_width=w,
        architecture="tiny-mtp",
        fingerprint=FINGERPRINT,
        dtype="float32",
        quantization="none",
        device_name="test-cpu-9000",
    )


def make_table(points=None, model="additive"):
    gs = (1, 2, 3, 4, 6, 8, 12, 16)
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3, 4: 0.9},
        theta_ms={g: 0.05 * g for g in gs},
        points=points,
        draft_width=3,
        contexts=CONTEXTS,
        context_offsets_ms=(0.0, 1.5),
        noise_ms=0.03,
        seed=7,
    )
    return build_table(df, model=model, compatibility=compat())


@pytest.fixture(scope="module")
def table():
    return make_table()


def test_title_names_device_and_shortened_fingerprint(table):
    title = table_title(table)
    assert "tiny-mtp" in title and "test-cpu-9000" in title and "cpu" in title
    assert short_fingerprint(FINGERPRINT) in title
    assert FINGERPRINT not in title  # shortened
    assert short_fingerprint("abc") == "abc"
    assert short_fingerprint(FINGERPRINT, keep=8) == "sha256:01234567\u2026"
    # The scheme is not counted: the digest characters are what tell two weights apart.
    assert short_fingerprint("preset:de8984fbac9cf423eb4d") == "preset:de8984fbac9c\u2026"
    assert short_fingerprint("0123456789abcdef", keep=4) == "0123\u2026"


def test_fit_figure_draws_table_costs_and_every_window(table):
    fig = fit_figure(table)
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(axes) == len(CONTEXTS)
    geom = table.geometry()
    windows = table.measurements()
    for ax, fit in zip(axes, table.fits, strict=True):
        assert "G" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        for b in geom.request_buckets:
            ln = lines[f"Bcap {b}"]
            assert list(ln.get_xdata()) == list(geom.target_rows[b])
            want = [table.cost_ms(b, g, fit.min_kv_length).cost_ms for g in geom.target_rows[b]]
            np.testing.assert_allclose(ln.get_ydata(), want)
        # every measured window of this context is a scatter point
        drawn = np.concatenate([c.get_offsets()[:, 1] for c in ax.collections])
        mine = windows[windows["context_index"] == fit.context_index]["step_ms"].to_numpy()
        assert np.isin(np.round(mine, 9), np.round(drawn, 9)).all()
    assert table_title(table) in fig._suptitle.get_text()


def test_fit_figure_leaves_a_gap_at_an_uncalibrated_g():
    # G = 12 is never measured: the additive table cannot price (4, 12), so the line breaks there.
    pts = [(b, b * j) for b in (1, 2, 4) for j in range(1, 5) if b * j != 12]
    t = make_table(points=pts)
    fig = fit_figure(t)
    ln = {x.get_label(): x for x in fig.axes[0].get_lines()}["Bcap 4"]
    y = dict(zip(ln.get_xdata(), ln.get_ydata(), strict=True))
    assert np.isnan(y[12]) and np.isfinite(y[16])


def test_residual_map_holds_the_diagnostics(table):
    fig = residuals_figure(table)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 2 * len(CONTEXTS)
    for i, fit in enumerate(table.fits):
        ms, pct = (np.ma.filled(images[2 * i + j].get_array(), np.nan) for j in (0, 1))
        bcaps = sorted({p.bcap for p in fit.diagnostics.points})
        gs = sorted({p.g for p in fit.diagnostics.points})
        assert ms.shape == (len(bcaps), len(gs))
        seen = np.zeros(ms.shape, dtype=bool)
        for p in fit.diagnostics.points:
            r, c = bcaps.index(p.bcap), gs.index(p.g)
            assert ms[r, c] == pytest.approx(p.residual_ms)
            assert pct[r, c] == pytest.approx(p.residual_pct)
            seen[r, c] = True
        assert np.isnan(ms[~seen]).all()  # unmeasured cells stay blank
        assert (~seen).any()  # e.g. Bcap 1 at G 16
        assert "Bcap" in images[2 * i].axes.get_ylabel()


def test_components_figure_shows_alpha_theta_and_reference(table):
    fig = components_figure(table)
    ax_a, ax_t = fig.axes[:2]
    for ax, attr_x, attr_y in ((ax_a, "bcap_levels", "alpha_ms"), (ax_t, "g_levels", "theta_ms")):
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("KV")]
        assert len(lines) == len(CONTEXTS)
        for ln, fit in zip(lines, table.fits, strict=True):
            assert list(ln.get_xdata()) == getattr(fit.additive, attr_x)
            np.testing.assert_allclose(ln.get_ydata(), getattr(fit.additive, attr_y))
            assert f"{fit.additive.bias_ms:.3f} ms" in ln.get_label()
        refs = [c for c in ax.collections if "reference level" in c.get_label()]
        assert len(refs) == 1
        x0 = min(getattr(table.fits[0].additive, attr_x))
        assert tuple(refs[0].get_offsets()[0]) == (x0, 0.0)
        assert "(ms)" in ax.get_ylabel()


def test_components_refused_for_sps_table(table):
    sps = refit_table(table, model="sps")
    with pytest.raises(InputError, match="table.model"):
        components_figure(sps)


def test_write_table_plots_writes_pngs(table, tmp_path):
    paths = write_table_plots(table, tmp_path / "figs")
    assert [p.name for p in paths] == [
        "table_fit.png",
        "table_residuals.png",
        "table_components.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC
    sps_paths = write_table_plots(refit_table(table, model="sps"), tmp_path / "sps")
    assert [p.name for p in sps_paths] == ["table_fit.png", "table_residuals.png"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="out"):
        write_table_plots(table, tmp_path / "file")


def test_plotting_does_not_import_torch():
    code = "import sys, speccal.plots_table\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
