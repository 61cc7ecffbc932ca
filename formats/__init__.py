"""File formats: KDTR (``formats.kdtr``), its HDF5 bridge (``formats.hdf5``), the inspector.

Modules from the bottom up, each importing only modules listed before it: ``dtypes``,
``layout``, ``checksum``, ``progress``, ``paths`` (the folder an output goes in); the core that
the reader, the writer and the API share: ``errors`` (``KdtrError``), ``names`` (name rules),
``attributes`` (attribute value codec); ``console`` (how every console script of the project
reports bad input: ``UsageError``, ``run_console``); ``reader``, ``writer``; ``kdtr`` (the
h5py-style API); ``int4_group`` (the int4-group weight format that bundles, the reference
and kdtr-dump share; it uses ``dtypes`` and works on any kdtr/h5py group it is handed);
``hdf5_mapping``, ``hdf5``, ``safetensors_io``, ``sample``; ``dump`` (the kdtr-dump package).
"""
