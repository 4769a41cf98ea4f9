"""Reading fxquant's report in tests: a layer's row with the notes under it, and a wrapped list read whole."""


def layer_rows(report: str) -> dict[str, str]:
    """Layer name -> its row and the indented lines under it (why it was kept, merged rows, auto's choice; a name too
    long for its row stands alone, its cells on the next line). The table runs from its header to a blank line."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    rows, name = {}, None
    for line in lines[start + 1:]:
        if not line:
            break
        if not line[0].isspace():
            name = line.split()[0]
            rows[name] = line
        else:
            rows[name] += " " + line.strip()
    return rows


def section(report: str, label: str) -> str:
    """The text after `label`, with the indented lines that continue it; "" where the report has no such line."""
    if label not in report:
        return ""
    first, *rest = report.split(label, 1)[1].split("\n")
    more = []
    for line in rest:
        if not line.startswith("  "):
            break
        more.append(line.strip())
    return " ".join([first.strip(), *more])
