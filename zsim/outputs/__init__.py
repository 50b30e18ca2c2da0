"""The outputs: results as JSON-ready dicts, terminal tables and figures (matplotlib, Agg), each a
function of results; the caller prints or saves."""
