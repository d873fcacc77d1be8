"""From recorded turns to published Parquet: recorder, stitching, schema, shards."""
