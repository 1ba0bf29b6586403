{{/*
Naming and labels, in the style of the ingress-nginx and cert-manager charts.
Every name is cut to 63 characters: Kubernetes label values and most names allow no more.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kubellm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The resource-name prefix: fullnameOverride, or "<release>-<name>" unless the release already says it. */}}
{{- define "kubellm.fullname" -}}
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

{{/* "<fullname>-<component>", cut to 63: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kubellm.componentName" -}}
{{- $full := include "kubellm.fullname" .ctx | trunc (int (sub 62 (len .component))) | trimSuffix "-" }}
{{- printf "%s-%s" $full .component }}
{{- end }}

{{/* Chart label value: name-version. */}}
{{- define "kubellm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "kubellm.labels" -}}
helm.sh/chart: {{ include "kubellm.chart" . }}
app.kubernetes.io/name: {{ include "kubellm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubellm
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kubellm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubellm.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kubellm.componentLabels" -}}
{{ include "kubellm.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* ServiceAccount name of one component: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kubellm.serviceAccountName" -}}
{{- $values := index .ctx.Values .component }}
{{- if $values.serviceAccount.create }}
{{- default (include "kubellm.componentName" .) $values.serviceAccount.name }}
{{- else }}
{{- default "default" $values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference; the tag defaults to the chart's appVersion. */}}
{{- define "kubellm.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The gateway Service's in-cluster URL. */}}
{{- define "kubellm.gatewayMetricsUrl" -}}
{{- printf "http://%s.%s.svc:%v/metrics" (include "kubellm.componentName" (dict "ctx" . "component" "gateway-metrics")) .Release.Namespace .Values.gateway.metricsPort }}
{{- end }}

{{- define "kubellm.gatewayUrl" -}}
{{- printf "http://%s.%s.svc:%v" (include "kubellm.componentName" (dict "ctx" . "component" "gateway")) .Release.Namespace .Values.gateway.service.port }}
{{- end }}

{{/*
The pod template shared by the three components: restricted security context, the one image,
the downward-API namespace. Call with (dict "ctx" $ "component" "gateway" "args" (list ...)
"ports" (list ...) "probes" dict), optionally "volumes" and "mounts" (lists) and "checksum"
(a pod annotation that rolls the pods when a mounted file changes).
*/}}
{{- define "kubellm.podTemplate" -}}
{{- $ctx := .ctx }}
{{- $values := index $ctx.Values .component }}
metadata:
  labels:
    {{- include "kubellm.selectorLabels" . | nindent 4 }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $values.podAnnotations .checksum }}
  annotations:
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with .checksum }}
    checksum/tenants: {{ . }}
    {{- end }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kubellm.serviceAccountName" . }}
  automountServiceAccountToken: true
  securityContext:
    {{- toYaml $ctx.Values.podSecurityContext | nindent 4 }}
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "kubellm.image" $ctx }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      args:
        {{- toYaml .args | nindent 8 }}
        {{- with $values.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- with $values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .probes }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      resources:
        {{- toYaml $values.resources | nindent 8 }}
      securityContext:
        {{- toYaml $ctx.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        # The root file system is read-only; scratch space (temp files, client certs) goes here.
        - name: tmp
          mountPath: /tmp
        {{- with .mounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: 64Mi
    {{- with .volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
