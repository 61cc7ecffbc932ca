"""File formats: KDTR (``formats.kdtr``), its HDF5 bridge (``formats.hdf5``), the inspector.

Modules from the bottom up, each importing only modules listed before it: ``dtypes``,
``layout``, ``checksum``, ``progress``; the core that the reader, the writer and the API share:
``errors`` (``KdtrError``), ``names`` (name rules), ``attributes`` (attribute value codec);
``reader``, ``writer``; ``kdtr`` (the h5py-style API); ``hdf5_mapping``, ``hdf5``,
``safetensors_io``, ``sample``; ``dump`` (the kdtr-dump package).
"""
