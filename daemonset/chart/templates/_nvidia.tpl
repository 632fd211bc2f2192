{{/* Values of NVIDIA k8s-device-plugin's chart (deployments/helm/nvidia-device-plugin) that this
chart does not have, each with what to do instead: a values file brought from NVIDIA's chart is
refused saying so, rather than with the schema's bare "not allowed". (migStrategy and
deviceListStrategy are config settings: vgpu.validate says where they go. nvidiaDriverRoot,
deviceIDStrategy, failOnInitError, config.* and the pod's settings mean here what they mean
there.) */}}
{{- define "vgpu.nvidiaOnlyValues" -}}
compatWithCPUManager: >-
  vgpu needs no privileged pod to put device nodes in containers: set
  config.flags.plugin.passDeviceSpecs=true (NVIDIA's format) or
  config.allocation.deviceListStrategy={envvar,device-specs} (vgpu's) instead
gdrcopyEnabled: vgpu does not pass GDRCopy devices to containers; leave it out
gdsEnabled: vgpu does not pass GPUDirect Storage devices to containers; leave it out
mofedEnabled: vgpu does not pass MOFED devices to containers; leave it out
deviceDiscoveryStrategy: vgpu always finds the GPUs through NVML; leave it out
nvidiaDevRoot: >-
  vgpu uses the device nodes the NVIDIA container runtime gives its pod; for the GPU Operator's
  driver container set hostPaths.driverRoot
namespaceOverride: vgpu installs into the release's namespace; use helm install -n NAMESPACE
allowDefaultNamespace: vgpu installs into the release's namespace, whichever it is; leave it out
selectorLabelsOverride: >-
  vgpu's pods are selected by app.kubernetes.io/name and app.kubernetes.io/instance; use
  nameOverride, or podLabels for labels of your own
componentSelectorLabels: >-
  vgpu's pods are selected by app.kubernetes.io/name and app.kubernetes.io/instance; leave it out
devicePlugin: >-
  this chart deploys the device plugin and nothing else, always; leave devicePlugin out
gfd: >-
  vgpu does not deploy GPU feature discovery (the nvidia.com/gpu.* node labels): keep it from
  NVIDIA's chart (helm upgrade RELEASE nvdp/nvidia-device-plugin --set devicePlugin.enabled=false
  --set gfd.enabled=true) or the GPU Operator; vgpu's own node labels go through node feature
  discovery (nodeLabels); docs/migrating.md says what happens to the labels
nfd: >-
  vgpu does not deploy node feature discovery: install it on its own (v0.15 or newer) for
  nodeLabels; docs/migrating.md says what happens to the labels when NVIDIA's release goes
cdi: >-
  vgpu does not write NVIDIA's CDI spec: in DRA mode run nvidia-ctk cdi generate
  --device-name-strategy=uuid on the nodes (dra.gpuCdi=nvidia) or set dra.gpuCdi=device-nodes
{{- end -}}

{{/* NVIDIA's mps values beside this chart's mps.enabled and mps.root. */}}
{{- define "vgpu.nvidiaOnlyMpsValues" -}}
enableHostPID: vgpu's pod always runs in the host's PID namespace; leave it out
enableHostNetwork: vgpu's pod never needs the host's network; leave it out
{{- end -}}

{{/* Refuse every NVIDIA-only value that is set, each with its hint. */}}
{{- define "vgpu.refuseNvidiaValues" -}}
{{- $found := list -}}
{{- range $key, $hint := include "vgpu.nvidiaOnlyValues" . | fromYaml -}}
{{- if hasKey $.Values $key -}}
{{- $found = append $found (printf "%s (NVIDIA's chart): %s" $key $hint) -}}
{{- end -}}
{{- end -}}
{{- range $key, $hint := include "vgpu.nvidiaOnlyMpsValues" . | fromYaml -}}
{{- if hasKey $.Values.mps $key -}}
{{- $found = append $found (printf "mps.%s (NVIDIA's chart): %s" $key $hint) -}}
{{- end -}}
{{- end -}}
{{- if $found -}}
{{- fail (printf "values of NVIDIA's chart that this chart does not have:\n- %s" (join "\n- " $found)) -}}
{{- end -}}
{{- end -}}
