"""The terminal bar plot shared by `tinyinfer simulate --sweep` and the simulator TUI."""

from tinyinfer.display.bars import BarColumn, bar, bar_table


def filled_eighths(cells: str) -> int:
    """How many eighths of a cell a bar fills: 8 per full block, the tip's index in the ramp."""
    return sum(8 if ch == "█" else " ▏▎▍▌▋▊▉".index(ch) for ch in cells)


def test_bar_fills_cells_in_proportion_to_the_value():
    for value, top, width in [(1, 4, 8), (3, 7, 10), (0.5, 1, 1), (5, 5, 12), (1, 1000, 20)]:
        cells = bar(value, top, width)
        assert len(cells) == width
        assert filled_eighths(cells) == round(8 * width * value / top)
    assert bar(0, 10, 5) == " " * 5 and bar(3, 0, 4) == " " * 4


def test_bar_table_scales_each_column_to_its_own_largest_value_and_aligns_the_labels():
    labels = ["1", "16", "256"]
    rates = BarColumn("rate", [5.0, 40.0, 120.0], lambda v: f"{v:.0f}/s")
    times = BarColumn("time", [2.0, 1.0, 0.5], lambda v: f"{v} s")
    lines = bar_table("batch", labels, [rates, times], width=16, notes=["", "", "fast"])
    header, rows = lines[0], lines[1:]
    assert header.split() == ["batch", "rate", "time"]
    assert [row.split()[0] for row in rows] == labels
    assert {row.index(label) + len(label) for row, label in zip(rows, labels)} == {len("batch")}
    rate_start, time_start = header.index("rate"), header.index("time")
    for row, rate, time in zip(rows, rates.values, times.values):
        assert filled_eighths(row[rate_start:rate_start + 16]) == round(8 * 16 * rate / 120)
        assert filled_eighths(row[time_start:time_start + 16]) == round(8 * 16 * time / 2)
    assert len({row.index("/s") for row in rows}) == 1  # "5/s" and "120/s" end in one column
    assert rows[2].endswith("  fast") and not rows[0].endswith(" ")
