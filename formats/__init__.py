"""File formats: KDTR (``formats.kdtr``), its HDF5 bridge (``formats.hdf5``), the inspector."""
