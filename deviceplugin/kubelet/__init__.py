"""The kubelet plumbing both frontends share: its generated API (`proto`), the pod-resources
client, the device checkpoint reader, the watch of its directories and the device list's size
limit."""
