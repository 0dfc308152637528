"""In-process tests, one folder per package of pipeline/."""
