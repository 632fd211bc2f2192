"""vgpu as a DRA driver (docs/dra.md): the same daemon and enforcement, served to the kubelet
through Dynamic Resource Allocation instead of the device-plugin API.

- `slices`: the node's ResourceSlice, one device per GPU (and MIG device) with consumable
  `memory` and `compute` (pure).
- `claims`: a ResourceClaim's allocation for this driver, read into a prepared claim, and what
  its containers get (pure).
- `cdi`: the CDI spec of a prepared claim, written and removed without following a symlink.
- `refs`: what a claim's namespace, name and UID may be, checked before any is used (pure).
- `store`: the prepared claims, checkpointed in the state directory.
- `prepare`: NodePrepareResources/NodeUnprepareResources, ordered per claim, and the
  reconcile of the prepared claims against the API server.
- `kubeapi`: the API server, through lightkube's async client.
- `publisher`: the node's ResourceSlice kept on the API server.
- `users`: who uses a prepared claim, from the kubelet's pod-resources DRA entries.
- `driver`: the prepared claims and the kubelet's calls on them; it owns no socket (the shared
  `kubelet.draplugin` helper serves and registers it).
- `frontend`: the parts put together as the daemon's kubelet frontend in `--kubelet-api dra`
  mode.
"""
