"""The coordinator's store: connections, the authenticated gateway, the key schema, and the durable state (journal
or etcd)."""
