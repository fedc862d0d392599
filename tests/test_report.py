from lavo.report import panel_plot


def test_panel_plot_draws_the_panels_with_points_and_nothing_without(tmp_path):
    path = tmp_path / "panels.png"
    assert panel_plot({"empty": {"seed 0": []}}, path, xlabel="x", ylabel="y", title="t") is None
    assert not path.exists()
    panels = {"a": {"seed 0": [(1, 2.0), (2, 3.0)], "seed 1": [(1, None), (2, 1.0)]}, "b": {"seed 1": [(1, 1.0)]},
              "empty": {"seed 0": [(1, None)]}}
    assert panel_plot(panels, path, xlabel="x", ylabel="y", title="t", hlines={"seed 0": 1.5}, columns=2) == path
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # the panel without a point is left out: two panels fill one row of two, 2.6 x 2.8 inches at 120 dpi
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (624, 336)
