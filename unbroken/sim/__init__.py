"""The cluster simulator (pure Python + numpy): scenarios, failure timelines, the event loop and reports."""
