"""File formats: KDTR (``formats.kdtr``), its HDF5 bridge (``formats.hdf5``), the inspector.

Layers, each importing only those below it: ``layout``, ``dtypes``, ``checksum``; ``errors``,
``names``, ``attributes`` (the core the reader, the writer and the public API share);
``reader``, ``writer``; ``kdtr`` (the h5py-style API); ``hdf5_mapping``, ``hdf5``,
``safetensors_io``, ``sample``; ``progress``; ``dump`` (kdtr-dump).
"""
