{{/*
Names, labels, paths and value checks shared by the templates.
*/}}

{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name for namespaced and cluster-scoped objects. */}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tessera.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ include "tessera.chart" . }}
{{ include "tessera.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tessera.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Host paths. The kubelet dials the socket paths the plugin announces, so these are mounted at the same path in the container. */}}
{{- define "tessera.kubeletDir" -}}
{{- trimSuffix "/" .Values.kubeletDir }}
{{- end }}

{{- define "tessera.registrarDir" -}}
{{- printf "%s/plugins_registry" (include "tessera.kubeletDir" .) }}
{{- end }}

{{- define "tessera.devicePluginsDir" -}}
{{- printf "%s/device-plugins" (include "tessera.kubeletDir" .) }}
{{- end }}

{{- define "tessera.pluginsDir" -}}
{{- printf "%s/plugins" (include "tessera.kubeletDir" .) }}
{{- end }}

{{/* The driver's own directory: sockets, checkpoint, MPS pipe/log/shm directories. */}}
{{- define "tessera.pluginDataDir" -}}
{{- printf "%s/%s" (include "tessera.pluginsDir" .) .Values.driverName }}
{{- end }}

{{/* MPS daemons' pipe, log and per-daemon shm directories (the plugin's <state dir>/mps). */}}
{{- define "tessera.mpsDir" -}}
{{- printf "%s/mps" (include "tessera.pluginDataDir" .) }}
{{- end }}

{{/* The /dev/shm all MPS daemons and clients share when daemons get no private one (Settings.mps_shm_dir). */}}
{{- define "tessera.mpsShmDir" -}}
{{- printf "%s/mps-shm" (include "tessera.pluginDataDir" .) }}
{{- end }}

{{/* The MPS host's socket, in a directory of its own (mode 0700). */}}
{{- define "tessera.mpsHostSocketDir" -}}
{{- printf "%s/mps-host" (include "tessera.pluginDataDir" .) }}
{{- end }}

{{- define "tessera.mpsHostSocket" -}}
{{- printf "%s/mps-host.sock" (include "tessera.mpsHostSocketDir" .) }}
{{- end }}

{{/* mount(8) tmpfs size= takes k/m/g suffixes meaning KiB/MiB/GiB, so only binary quantities convert exactly. */}}
{{- define "tessera.shmSizeOption" -}}
{{- $size := toString .Values.mps.shmSize }}
{{- if not (regexMatch "^[1-9][0-9]*(Mi|Gi|Ti)$" $size) }}
{{- fail (printf "mps.shmSize: expected a binary quantity such as 512Mi or 1Gi, got %q" $size) }}
{{- end }}
{{- $size | trimSuffix "i" | lower }}
{{- end }}

{{/* The sharing plans file the plugin reads (format: examples/sharing-plans.yaml). */}}
{{- define "tessera.sharingPlansFile" -}}
{{- $file := dict "plans" (.Values.sharing.plans | default dict) }}
{{- with .Values.sharing.defaultPlan }}
{{- $_ := set $file "defaultPlan" . }}
{{- end }}
{{- if .Values.sharing.consumableCapacityGate }}
{{- $_ := set $file "consumableCapacityGate" true }}
{{- end }}
{{- if .Values.sharing.partitionableDevicesGate }}
{{- $_ := set $file "partitionableDevicesGate" true }}
{{- end }}
{{- toYaml $file }}
{{- end }}

{{/*
Checks that span several values, so a bad install fails at render time with the value named
instead of as a crash-looping pod.
*/}}
{{- define "tessera.validateValues" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$" .Values.driverName) }}
{{- fail (printf "driverName: expected a lower-case DNS subdomain with at least one dot, such as gpu.tessera.dev, got %q" .Values.driverName) }}
{{- end }}
{{- if gt (len .Values.driverName) 63 }}
{{- fail (printf "driverName: at most 63 characters, got %d (%q)" (len .Values.driverName) .Values.driverName) }}
{{- end }}
{{- with .Values.sharing.defaultPlan }}
{{- $plans := $.Values.sharing.plans | default dict }}
{{- if not (hasKey $plans .) }}
{{- $known := ternary "sharing.plans is empty" (printf "known plans: %s" (keys $plans | sortAlpha | join ", ")) (empty $plans) }}
{{- fail (printf "sharing.defaultPlan: %q is not a plan in sharing.plans (%s)" . $known) }}
{{- end }}
{{- end }}
{{- if and .Values.mps.host.enabled (not .Values.mps.hostPID) }}
{{- fail "mps.hostPID: must be true while mps.host.enabled is (the plugin finds the MPS host's daemons in /proc)" }}
{{- end }}
{{- if and .Values.extendedResourceName (not .Values.deviceClasses.gpu.enabled) }}
{{- fail "extendedResourceName is set on the whole-GPU DeviceClass, but deviceClasses.gpu.enabled is false" }}
{{- end }}
{{- end }}

{{/*
The NVIDIA driver root as the plugin sees it, at /driver-root (volumeMounts, then volumes). For a
host-installed driver ("/") only hostDriverDirs, each at its own path under /driver-root: the
whole host root would put every host file (keys, kubelet credentials) into a privileged pod that
needs none of them. For a containerised driver (the GPU Operator's /run/nvidia/driver) the whole
root, HostToContainer: the driver container mounts itself there, dev/ included, possibly after the
plugin started, and again after each restart.
*/}}
{{- define "tessera.driverRootVolumeMounts" -}}
{{- if eq (trimSuffix "/" .Values.nvidiaDriverRoot) "" }}
{{- range $i, $dir := .Values.hostDriverDirs }}
- name: driver-dir-{{ $i }}
  mountPath: /driver-root{{ $dir }}
  readOnly: true
{{- end }}
{{- else }}
- name: driver-root
  mountPath: /driver-root
  readOnly: true
  mountPropagation: HostToContainer
{{- end }}
{{- end }}

{{- define "tessera.driverRootVolumes" -}}
{{- if eq (trimSuffix "/" .Values.nvidiaDriverRoot) "" }}
{{- range $i, $dir := .Values.hostDriverDirs }}
- name: driver-dir-{{ $i }}
  hostPath:
    path: {{ $dir }}
    type: Directory
{{- end }}
{{- else }}
- name: driver-root
  hostPath:
    path: {{ .Values.nvidiaDriverRoot }}
    type: DirectoryOrCreate
{{- end }}
{{- end }}
