package flywheel;

import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.functions.AggregateFunction;
import org.apache.flink.types.Row;

/**
 * Impressions and clicks of an entity in the sliding window of {@code buckets} time buckets of
 * {@code bucketMs} each that ends with the bucket of the entity's newest event:
 * {@code window_counts(event_time, is_impression, is_click, bucket_ms, buckets)} in a GROUP BY of the
 * entity.
 *
 * <p>The state is a ring of per-bucket counts: an event adds to its bucket's slot, and a newer bucket
 * clears the slots of the buckets that leave the window. So one aggregate per entity holds the window
 * (no row per window an event falls in), the result is out with the event (no watermark), and a late
 * event counts if its bucket is still in the window. An event older than the window changes nothing.
 */
@FunctionHint(output = @DataTypeHint("ROW<impressions BIGINT, clicks BIGINT>"))
public class WindowCounts extends AggregateFunction<Row, WindowCounts.Ring> {

    /** Slot {@code floorMod(bucket, size)} counts the bucket; slots hold buckets newest-size+1..newest. */
    public static class Ring {
        public long newest = Long.MIN_VALUE;
        public long[] impressions = new long[0];
        public long[] clicks = new long[0];
    }

    @Override
    public Ring createAccumulator() {
        return new Ring();
    }

    public void accumulate(Ring ring, Long eventTime, Integer isImpression, Integer isClick, Integer bucketMs,
                           Integer buckets) {
        if (eventTime == null) {
            return;
        }
        int slot = advance(ring, Math.floorDiv(eventTime, (long) bucketMs), buckets);
        if (slot >= 0) {
            ring.impressions[slot] += isImpression;
            ring.clicks[slot] += isClick;
        }
    }

    /** Moves the window to end no earlier than {@code bucket}; the slot of {@code bucket}, or -1 if it left. */
    private static int advance(Ring ring, long bucket, int size) {
        if (ring.impressions.length != size) {
            ring.impressions = new long[size];
            ring.clicks = new long[size];
        }
        if (bucket > ring.newest) {
            long cleared = ring.newest == Long.MIN_VALUE ? size : Math.min(size, bucket - ring.newest);
            for (long b = bucket - cleared + 1; b <= bucket; b++) {
                int slot = (int) Math.floorMod(b, (long) size);
                ring.impressions[slot] = 0;
                ring.clicks[slot] = 0;
            }
            ring.newest = bucket;
        }
        return bucket <= ring.newest - size ? -1 : (int) Math.floorMod(bucket, (long) size);
    }

    /** For two-phase aggregation (a mini-batch's local rings into the global one). */
    public void merge(Ring ring, Iterable<Ring> others) {
        for (Ring other : others) {
            int size = other.impressions.length;
            if (size == 0) {
                continue;
            }
            advance(ring, other.newest, size);
            for (long b = other.newest - size + 1; b <= other.newest; b++) {
                int from = (int) Math.floorMod(b, (long) size);
                int to = advance(ring, b, size);
                if (to >= 0) {
                    ring.impressions[to] += other.impressions[from];
                    ring.clicks[to] += other.clicks[from];
                }
            }
        }
    }

    @Override
    public Row getValue(Ring ring) {
        long impressions = 0;
        long clicks = 0;
        for (int i = 0; i < ring.impressions.length; i++) {
            impressions += ring.impressions[i];
            clicks += ring.clicks[i];
        }
        return Row.of(impressions, clicks);
    }
}
