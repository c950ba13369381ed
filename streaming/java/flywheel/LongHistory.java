package flywheel;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.functions.AggregateFunction;
import org.apache.flink.types.Row;

/**
 * A user's long behavior history, condensed the moment it changes into fixed-size model inputs:
 * {@code long_history(item_id, category, capacity, categories, per_category)} in a GROUP BY of the user.
 *
 * <p>The state is a ring of the user's newest {@code capacity} behaviors (item and category, in arrival
 * order): bounded, and checkpointed with the job like any aggregate. Each update emits, SIM-style (search
 * by the candidate's category, done ahead of the request): how many behaviors the ring holds; the user's
 * {@code categories} most frequent categories in it (ties: the most recent first) with their counts; and,
 * for each of those, its newest {@code per_category} items, newest first, padded with "" to exactly
 * {@code per_category} slots. What a request reads is then fixed in size whatever the history's length.
 */
@FunctionHint(output = @DataTypeHint(
        "ROW<history_length BIGINT, categories ARRAY<STRING>, counts ARRAY<BIGINT>, items ARRAY<STRING>>"))
public class LongHistory extends AggregateFunction<Row, LongHistory.Ring> {

    /** Slot {@code (start + i) % items.length} holds the i-th oldest of {@code size} behaviors. */
    public static class Ring {
        public String[] items = new String[0];
        public String[] categories = new String[0];
        public int start = 0;
        public int size = 0;
        public int topCategories = 0;
        public int perCategory = 0;
    }

    @Override
    public Ring createAccumulator() {
        return new Ring();
    }

    public void accumulate(Ring ring, String item, String category, Integer capacity, Integer categories,
                           Integer perCategory) {
        if (item == null) {
            return;
        }
        if (ring.items.length != capacity) {
            resize(ring, capacity);
        }
        ring.topCategories = categories;
        ring.perCategory = perCategory;
        add(ring, item, category == null ? "" : category);
    }

    private static void add(Ring ring, String item, String category) {
        int capacity = ring.items.length;
        int slot = (ring.start + ring.size) % capacity;
        ring.items[slot] = item;
        ring.categories[slot] = category;
        if (ring.size < capacity) {
            ring.size++;
        } else {
            ring.start = (ring.start + 1) % capacity;  // the oldest leaves
        }
    }

    /** A new capacity (a changed setting) keeps the newest behaviors that fit. */
    private static void resize(Ring ring, int capacity) {
        Ring old = new Ring();
        old.items = ring.items;
        old.categories = ring.categories;
        old.start = ring.start;
        old.size = ring.size;
        ring.items = new String[capacity];
        ring.categories = new String[capacity];
        ring.start = 0;
        ring.size = 0;
        for (int i = Math.max(0, old.size - capacity); i < old.size; i++) {
            int slot = (old.start + i) % old.items.length;
            add(ring, old.items[slot], old.categories[slot]);
        }
    }

    /** For two-phase aggregation: a mini-batch's local ring holds newer behaviors than the global one. */
    public void merge(Ring ring, Iterable<Ring> others) {
        for (Ring other : others) {
            if (other.size == 0) {
                continue;
            }
            ring.topCategories = other.topCategories;
            ring.perCategory = other.perCategory;
            if (ring.items.length != other.items.length) {
                resize(ring, other.items.length);
            }
            for (int i = 0; i < other.size; i++) {
                int slot = (other.start + i) % other.items.length;
                add(ring, other.items[slot], other.categories[slot]);
            }
        }
    }

    @Override
    public Row getValue(Ring ring) {
        // Per category (in order of first sight from the newest behavior back): count and newest items.
        Map<String, Integer> index = new HashMap<>();
        List<String> seen = new ArrayList<>();
        List<long[]> counts = new ArrayList<>();  // [count, recency rank of the newest behavior]
        List<List<String>> newest = new ArrayList<>();
        for (int i = ring.size - 1; i >= 0; i--) {
            int slot = (ring.start + i) % ring.items.length;
            String category = ring.categories[slot];
            Integer at = index.get(category);
            if (at == null) {
                at = seen.size();
                index.put(category, at);
                seen.add(category);
                counts.add(new long[] {0, ring.size - 1 - i});
                newest.add(new ArrayList<>());
            }
            counts.get(at)[0]++;
            if (newest.get(at).size() < ring.perCategory) {
                newest.get(at).add(ring.items[slot]);
            }
        }
        List<Integer> order = new ArrayList<>();
        for (int c = 0; c < seen.size(); c++) {
            order.add(c);
        }
        order.sort((a, b) -> counts.get(a)[0] != counts.get(b)[0]
                ? Long.compare(counts.get(b)[0], counts.get(a)[0])
                : Long.compare(counts.get(a)[1], counts.get(b)[1]));
        int kept = Math.min(ring.topCategories, order.size());
        String[] categories = new String[kept];
        Long[] categoryCounts = new Long[kept];
        String[] items = new String[kept * ring.perCategory];
        for (int k = 0; k < kept; k++) {
            int c = order.get(k);
            categories[k] = seen.get(c);
            categoryCounts[k] = counts.get(c)[0];
            List<String> list = newest.get(c);
            for (int j = 0; j < ring.perCategory; j++) {
                items[k * ring.perCategory + j] = j < list.size() ? list.get(j) : "";
            }
        }
        return Row.of((long) ring.size, categories, categoryCounts, items);
    }
}
