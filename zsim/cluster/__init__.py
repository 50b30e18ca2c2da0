"""The cluster: fabric presets and their names, the networkx graph of a cluster with its routes,
ranks and process groups, and the device profile (GPU presets, calibrated profiles)."""
