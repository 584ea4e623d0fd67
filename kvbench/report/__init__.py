"""The report (torch-free): tables, plots, sections, the HTML/Markdown page and the CI gate."""
