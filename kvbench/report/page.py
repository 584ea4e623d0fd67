"""One page written twice: self-contained HTML (inline CSS and a few lines of JS, images as data URIs, no
network; collapsible per-task parts that open for printing) and Markdown with the same content."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

from kvbench.report.tables import Column, html_table, markdown_table

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1240px;margin:0 auto;padding:0 20px 3em;
color:#1d1d1f}
h1{font-size:1.6em;margin:.8em 0 .1em}h2{font-size:1.3em;margin:1.6em 0 .4em;border-bottom:2px solid #e5e5e5;
padding-bottom:.2em}h3{font-size:1.08em;margin:1.1em 0 .3em}
.meta,.note{color:#555;font-size:.9em}nav{position:sticky;top:0;background:#fff;padding:.4em 0;
border-bottom:1px solid #eee;z-index:2;font-size:.92em}nav a{margin-right:1.2em;color:#0b57d0;text-decoration:none}
.card{display:grid;grid-template-columns:minmax(0,1.15fr) minmax(0,1fr);gap:18px;align-items:start;
margin:.4em 0 1.2em}.card ul{margin:0;padding-left:1.1em}.card li{margin:.25em 0}
img{max-width:100%;height:auto;display:block}.plots{display:grid;grid-template-columns:repeat(auto-fill,
minmax(520px,1fr));gap:14px;margin:.5em 0 1em}
details{margin:.3em 0 .8em}details details{margin-left:1.4em}table.left td,th.l,td.l{text-align:left}
summary{cursor:pointer;font-weight:600;padding:.2em 0}
.wrap{overflow-x:auto;max-width:100%}table{border-collapse:collapse;font-size:.84em;margin:.3em 0 .9em;
font-variant-numeric:tabular-nums}th,td{border-bottom:1px solid #e3e3e3;padding:3px 9px;text-align:right;
white-space:nowrap}th{background:#f5f5f7;position:relative;cursor:pointer;user-select:none}
th:first-child,td:first-child{text-align:left}tr.few td{color:#999}
.section{overflow-x:auto;max-width:100%}.section table{border:0}.section td{white-space:normal}
.section th,.section td{border:0;border-bottom:1px solid #e3e3e3}.more{display:none}
body.allcols .more{display:table-cell}.toggle{font-size:.9em;margin:.3em 0}
th.asc:after{content:" ▲";font-size:.7em}th.desc:after{content:" ▼";font-size:.7em}
@media print{nav,.toggle{display:none}body{max-width:none;font-size:11px}.card{grid-template-columns:1fr 1fr}
.wrap,.section{overflow:visible}table{font-size:8.5px}td,th{white-space:normal}
img,table,.card{break-inside:avoid}h2{break-after:avoid}}
@media (max-width:900px){.card{grid-template-columns:1fr}}
"""

JS = """
document.querySelectorAll('table.sortable th').forEach(function(th){th.addEventListener('click',function(){
var table=th.closest('table'),body=table.tBodies[0],i=Array.prototype.indexOf.call(th.parentNode.children,th),
asc=!th.classList.contains('asc');table.querySelectorAll('th').forEach(function(h){h.classList.remove('asc','desc')});
th.classList.add(asc?'asc':'desc');var rows=Array.prototype.slice.call(body.rows);rows.sort(function(a,b){
var x=a.cells[i],y=b.cells[i],u=x.dataset.v,v=y.dataset.v,r;if(u!==undefined&&v!==undefined){r=u-v}
else if(u!==undefined){r=-1}else if(v!==undefined){r=1}else{r=x.textContent.localeCompare(y.textContent)}
return asc?r:-r});rows.forEach(function(r){body.appendChild(r)})})});
var box=document.getElementById('allcols');if(box){box.addEventListener('change',function(){
document.body.classList.toggle('allcols',box.checked)})}
window.addEventListener('beforeprint',function(){document.querySelectorAll('details').forEach(function(d){
d.open=true})});
"""


class Page:
    """Appends the same content to the HTML body and the Markdown lines."""

    def __init__(self, title: str):
        self.title = title
        self.body: list[str] = [f"<h1>{html.escape(title)}</h1>"]
        self.md: list[str] = [f"# {title}", ""]

    def heading(self, level: int, text: str, anchor: str = "") -> None:
        ident = f' id="{anchor}"' if anchor else ""
        self.body.append(f"<h{level}{ident}>{html.escape(text)}</h{level}>")
        self.md += ["#" * level + " " + text, ""]

    def note(self, text: str, cls: str = "note") -> None:
        self.body.append(f'<p class="{cls}">{html.escape(text)}</p>')
        self.md += [text, ""]

    def raw(self, fragment: str, markdown: str = "") -> None:
        self.body.append(fragment)
        if markdown:
            self.md += [markdown, ""]

    def card(self, image: Path | None, lines: list[str]) -> None:
        """A headline plot beside its takeaways."""
        items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
        self.body.append(f'<div class="card">{img(image) if image else "<div></div>"}<ul>{items}</ul></div>')
        if image:
            self.md += [f"![{image.stem}]({image.name})", ""]
        self.md += [f"- {line}" for line in lines] + [""]

    def images(self, images: list[Path]) -> None:
        if images:
            self.body.append('<div class="plots">' + "".join(img(p) for p in images) + "</div>")
            self.md += [f"![{p.stem}]({p.name})" for p in images] + [""]

    def table(self, part: pd.DataFrame, columns: list[Column], few: pd.Series | None = None, cls: str = "") -> None:
        self.body.append(html_table(part, columns, few, cls))
        self.md += [markdown_table(part, columns), ""]

    def open(self, summary: str, is_open: bool = False) -> None:
        self.body.append(f"<details{' open' if is_open else ''}><summary>{html.escape(summary)}</summary>")
        self.md += [f"**{summary}**", ""]

    def close(self) -> None:
        self.body.append("</details>")

    def html(self, nav: list[tuple[str, str]]) -> str:
        links = "".join(f'<a href="#{a}">{html.escape(t)}</a>' for a, t in nav)
        body = [self.body[0], *(self.body[1:2] if len(self.body) > 1 else []), f"<nav>{links}</nav>", *self.body[2:]]
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{html.escape(self.title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + f"\n<script>{JS}</script>\n"
            "</body></html>\n"
        )

    def markdown(self) -> str:
        return "\n".join(self.md)


def img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'
