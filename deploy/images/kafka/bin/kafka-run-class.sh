#!/bin/sh
# kafka-run-class.sh CLASS [ARGS]: a Kafka tool class on the broker's jars, logging warnings to
# stderr only (the tools' output stays clean for scripts and health checks).
class="$1"; shift
exec java ${KAFKA_TOOLS_HEAP_OPTS:--Xmx256m} -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
  -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties -cp '/opt/kafka/libs/*' "$class" "$@"
