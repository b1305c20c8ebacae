"""The bundle format: what `kvrig package` writes and the phone reads (options, kvcache.json, manifest.json and
its verification). The pipeline that writes one is `kvrig.packaging`."""
